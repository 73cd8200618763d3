"""Model FLOPs per token: the one formula behind `train_flops_per_token` in the ledger and MFU.

    train_flops/token = 3 × forward_flops/token            (backward ≈ 2 × forward)
    forward_flops/token = 2 × Σ activated parameters (routed experts at k/E, no look-ups)
                        + Σ_layers 4 · H · D · (w̄ + k̄_l)     (q·k and p·v over the keys attended)
                        + Σ_index-layers 2 · H_I · D_I · n̄_l  (indexer scores over visible entries)

with, at sequence length T = cfg.seq_len and averaging over query positions t = 0..T−1:
w̄ = mean min(t + 1, W) window keys, k̄_l = mean min(k, ⌊(t+1)/m_l⌋) selected entries (0 on pure-SWA
layers) and n̄_l = mean ⌊(t+1)/m_l⌋ visible entries.

What it counts: model FLOPs, i.e. the multiply-adds a perfect implementation of the spec needs, so
MFU does not reward wasted work. It leaves out, by design:
  * elementwise work and reductions (norms, softmax, RoPE, SwiGLU, mHC Sinkhorn, the loss),
  * implementation excess: the "masked" global branch scores all N entries (the formula counts
    the k̄ attended), the block-local window scores (P+1)·S keys per query (the formula w̄), the
    indexer-loss attention distributions, capacity buffers (E·C rows = capacity_factor × the
    routed rows), the CPU expansion of `ragged_dot` over all E experts,
  * remat: the recomputed forward (another ~1× forward with layer remat),
  * the optimizer (Muon's Newton–Schulz matmuls are per step, not per token), the vision tower.

Cross-check (tests/dsv41_jax/test_flops.py, benchmarks/RESULTS.md "MFU formula vs XLA"): XLA's
`cost_analysis()['flops']` of jax.grad(loss) on one CPU device, four unrolled layers (d 256, T 64,
no remat, capacity buffers of exactly n·k/E rows) is 1.067 × this formula: its dot ops alone are
1.025 × (the attention excess above), the remaining 4.2 points are elementwise ops. With remat
XLA also counts the recompute, and how it counts a scanned (while-loop) body depends on its
trip-count analysis, so the comparison uses an unrolled, remat-free program.
"""

from __future__ import annotations

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.model import abstract_params
from dsv41_jax.param_paths import per_layer_params


def _mean_min(T: int, cap: float, m: int = 1) -> float:
  t = np.arange(T, dtype=np.float64)
  return float(np.minimum((t + 1) // m, cap).mean())


def active_matrix_params(cfg: ModelConfig, state=None) -> float:
  """Activated parameters per token (decode path: all layers and the head).

  Every layer parameter but the Engram tables (look-ups): the per-layer vectors (norm scales, mHC
  base and scale, attention sinks, Engram q_w/k_w) count too, 3.5e-5 of the total at Flash.
  `state` is the model's abstract parameter state when the caller already has it."""
  k_over_e = cfg.num_experts_per_tok / cfg.n_routed_experts
  total = 0.0
  state = abstract_params(cfg) if state is None else state
  for layer, rest, size in per_layer_params(cfg, state):
    if layer is None:
      if rest.startswith("head"):
        total += size
      continue
    if rest.startswith("engram/table"):
      continue
    total += size * (k_over_e if rest.startswith("moe/experts/") else 1.0)
  return total


def routed_expert_params_per_token(cfg: ModelConfig) -> float:
  """The routed-expert part of `active_matrix_params`: k/E of every layer's expert weights."""
  k_over_e = cfg.num_experts_per_tok / cfg.n_routed_experts
  return sum(size * k_over_e for layer, rest, size in per_layer_params(cfg, abstract_params(cfg))
             if layer is not None and rest.startswith("moe/experts/"))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
  T = cfg.seq_len if seq_len is None else seq_len
  plan = build_layer_plan(cfg)
  H, D = cfg.num_attention_heads, cfg.head_dim
  w_bar = _mean_min(T, cfg.sliding_window)
  total = 0.0
  for l in plan:
    k_bar = 0.0 if not l.reads_global_kv else _mean_min(T, cfg.index_topk, l.compress_ratio)
    total += 4.0 * H * D * (w_bar + k_bar)
    if l.owns_indexer:
      n_bar = _mean_min(T, np.inf, l.compress_ratio)
      total += 2.0 * cfg.index_n_heads * cfg.index_head_dim * n_bar
  return total


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, state=None) -> float:
  return 2.0 * active_matrix_params(cfg, state) + attention_flops_per_token(cfg, seq_len)


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, state=None) -> float:
  """`state`: the abstract parameter state, if the caller has it (saves a second eval_shape)."""
  return 3.0 * forward_flops_per_token(cfg, seq_len, state)
