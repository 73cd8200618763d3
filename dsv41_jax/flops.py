"""Model FLOPs per token: the one formula behind `train_flops_per_token` in the ledger and MFU.

    train_flops/token = 3 × (2 × N + attention core)   (backward ≈ 2 × forward)
                      + indexer forward + indexer backward
    N                 = Σ activated weight matrices (routed experts at k/E, no look-ups)
    attention core    = Σ_layers 4 · H · D · (w̄ + k̄_l)          (q·k and p·v over the keys attended)
    indexer forward   = Σ_index-layers 2 · H_I · D_I · n̄_l       (scores over the visible entries)
    indexer backward  = Σ_index-layers 4 · H_I · D_I · k̄_l       (dq and dk, the k selected entries)

with, at sequence length T = cfg.seq_len and averaging over query positions t = 0..T−1:
w̄ = mean min(t + 1, W) window keys, k̄_l = mean min(k, ⌊(t+1)/m_l⌋) selected entries (0 on pure-SWA
layers) and n̄_l = mean ⌊(t+1)/m_l⌋ visible entries. The indexer's only gradient is its KL loss
(docs/design.md §5.5), which reads the scores at the k selected entries, so a backward that the
spec needs touches those k, not the n̄ scored: its backward is not twice its forward.

N counts weight *matrices* only (`is_matrix`: two or more logical axes per layer, none of them an
elementwise `norm` axis): norm scales, mHC base and scale, attention sinks and Engram q_w/k_w are
elementwise, not products (0.5 % of the old count at configs/tiny.py, 3.5e-5 at Flash). Against
the former count (every layer weight, the indexer backward over all visible entries) the train
FLOPs per token are 1.6 % lower at configs/tiny.py, 1.4 % at s3 (T 2048), 3.1 % at Flash (T 64K).

What it counts: model FLOPs, i.e. the multiply-adds a perfect implementation of the spec needs, so
MFU does not reward wasted work. It leaves out, by design:
  * elementwise work and reductions (norms, softmax, RoPE, SwiGLU, mHC Sinkhorn, the loss),
  * implementation excess: the "masked" global branch scores all N entries (the formula counts
    the k̄ attended), the block-local window scores (P+1)·S keys per query (the formula w̄), the
    indexer-loss attention distributions, the indexer backward over every visible entry (the
    formula: the k̄ selected), capacity buffers (E·C rows = capacity_factor × the routed rows), the
    CPU expansion of `ragged_dot` over all E experts,
  * remat: the recomputed forward (another ~1× forward with layer remat),
  * the optimizer (Muon's Newton–Schulz matmuls are per step, not per token), the vision tower.

Cross-check (tests/dsv41_jax/test_flops.py, benchmarks/RESULTS.md "MFU formula vs XLA"): XLA's
`cost_analysis()['flops']` of jax.grad(loss) on one CPU device, four unrolled layers (d 256, T 64,
no remat, capacity buffers of exactly n·k/E rows) is within [1, 1.10) × this formula: XLA also
counts the attention and indexer excess above and the elementwise ops. With remat XLA also counts
the recompute, and how it counts a scanned (while-loop) body depends on its trip-count analysis,
so the comparison uses an unrolled, remat-free program.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.model import abstract_params
from dsv41_jax.param_paths import iter_params, path_str, per_layer_params


def _mean_min(T: int, cap: float, m: int = 1) -> float:
  t = np.arange(T, dtype=np.float64)
  return float(np.minimum((t + 1) // m, cap).mean())


def is_matrix(variable: nnx.Variable) -> bool:
  """A weight that a token multiplies in a matrix product: two or more logical axes (the axes of
  one layer; the layer scan's stacking axes carry no name) and no elementwise `norm` axis."""
  axes = sharding.param_axes(variable)
  return len(axes) >= 2 and "norm" not in axes


def _matrix_paths(state) -> set[str]:
  leaves = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  return {path_str(path) for path, v in leaves if is_matrix(v)}


def active_matrix_params(cfg: ModelConfig, state=None) -> float:
  """N: the weight matrices a token multiplies by (decode path: all layers and the head), routed
  experts at k/E; no look-ups (token embedding, Engram tables), no elementwise weights
  (`is_matrix`), no vision tower. `state`: the model's abstract parameter `nnx.State` (its
  Variables carry the logical axes), when the caller already has it."""
  k_over_e = cfg.num_experts_per_tok / cfg.n_routed_experts
  state = abstract_params(cfg) if state is None else state
  matrices = _matrix_paths(state)
  total = 0.0
  for path, shape in iter_params(state):
    if path not in matrices or path == "embed" or path.startswith(("vision/", "projector/")):
      continue
    if path.endswith("/engram/table"):
      continue
    total += math.prod(shape) * (k_over_e if "/moe/experts/" in path else 1.0)
  return total


def routed_expert_params_per_token(cfg: ModelConfig) -> float:
  """The routed-expert part of `active_matrix_params`: k/E of every layer's expert weights."""
  k_over_e = cfg.num_experts_per_tok / cfg.n_routed_experts
  return sum(size * k_over_e for layer, rest, size in per_layer_params(cfg, abstract_params(cfg))
             if layer is not None and rest.startswith("moe/experts/"))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
  """Forward: the attention core plus the indexer forward (see the module docstring)."""
  T = cfg.seq_len if seq_len is None else seq_len
  plan = build_layer_plan(cfg)
  H, D = cfg.num_attention_heads, cfg.head_dim
  w_bar = _mean_min(T, cfg.sliding_window)
  total = 0.0
  for l in plan:
    k_bar = 0.0 if not l.reads_global_kv else _mean_min(T, cfg.index_topk, l.compress_ratio)
    total += 4.0 * H * D * (w_bar + k_bar)
  return total + indexer_flops_per_token(cfg, T)[0]


def indexer_flops_per_token(cfg: ModelConfig, seq_len: int | None = None
                            ) -> tuple[float, float]:
  """(forward, backward) of the indexer scores: 2·H_I·D_I per visible entry forward, 4·H_I·D_I
  per selected entry backward (dq and dk of the KL loss, which reads only the top k)."""
  T = cfg.seq_len if seq_len is None else seq_len
  per_entry = 2.0 * cfg.index_n_heads * cfg.index_head_dim
  forward = backward = 0.0
  for l in build_layer_plan(cfg):
    if l.owns_indexer:
      forward += per_entry * _mean_min(T, np.inf, l.compress_ratio)
      backward += 2.0 * per_entry * _mean_min(T, cfg.index_topk, l.compress_ratio)
  return forward, backward


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, state=None) -> float:
  return 2.0 * active_matrix_params(cfg, state) + attention_flops_per_token(cfg, seq_len)


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, state=None) -> float:
  """3 × forward, but the indexer's backward only over the selected entries (module docstring).
  `state`: the abstract parameter state, if the caller has it (saves a second eval_shape)."""
  index_fwd, index_bwd = indexer_flops_per_token(cfg, seq_len)
  return 3.0 * forward_flops_per_token(cfg, seq_len, state) - 2.0 * index_fwd + index_bwd
