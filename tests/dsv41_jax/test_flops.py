"""`dsv41_jax.flops` against a naive per-query count and against XLA's own count of the compiled
forward + backward (the MFU numerator must match what the program really multiplies)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from configs.common import model_config
from dsv41_jax import flops, inputs, model as model_lib
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.loss import objective
from launch.aot import xla_flops
from launch.step import model_inputs


def _cfg(**over):
  """Four layers (SWA + Engram, Full m=2, Full m=1, Reindex), no vision, every layer unrolled and
  no remat: XLA's cost analysis counts a scan body once and remat adds a second forward."""
  base = dict(vision=None, scan_layers=False, remat=False, num_hidden_layers=4,
              compress_ratios=(0, 2, 1, 1), kv_source_layer_ids=(1, 2),
              index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2,
              engram_layer_ids=(0,), hidden_size=256, moe_intermediate_size=256,
              q_lora_rank=64, o_lora_rank=64, seq_len=64,
              # capacity buffers of exactly n·k/E rows per expert: XLA multiplies as many
              # (token, expert) rows as the formula counts (dropless ragged_dot on CPU is expanded
              # densely over all experts, and capacity factor c multiplies c × the routed rows)
              moe_dispatch="capacity", moe_capacity_factor=1.0)
  base.update(over)
  return model_config(tiny.get_config()).replace(**base)


def test_attention_flops_match_a_per_query_loop():
  """Σ over query positions of 4·H·D·(window keys + selected entries) + indexer 2·H_I·D_I·visible,
  counted one query at a time, against the closed form."""
  for T in (16, 23, 64, 100):
    cfg = _cfg(seq_len=T, sliding_window=16, index_topk=5)
    H, D = cfg.num_attention_heads, cfg.head_dim
    total = 0.0
    for spec in build_layer_plan(cfg):
      for t in range(T):
        keys = min(t + 1, cfg.sliding_window)
        if spec.compress_ratio:
          visible = (t + 1) // spec.compress_ratio
          keys += min(cfg.index_topk, visible)
          if spec.mode in ("full", "reindex"):
            total += 2 * cfg.index_n_heads * cfg.index_head_dim * visible
        total += 4 * H * D * keys
    np.testing.assert_allclose(flops.attention_flops_per_token(cfg), total / T, rtol=1e-12)


def test_train_is_three_forwards_but_the_indexer_backward_and_routed_experts_at_k_over_e():
  cfg = _cfg()
  f = flops.forward_flops_per_token(cfg)
  index_fwd, index_bwd = flops.indexer_flops_per_token(cfg)
  assert 0 < index_bwd < 2 * index_fwd   # k̄ selected < n̄ visible entries at T = 64, k = 8
  assert flops.train_flops_per_token(cfg) == pytest.approx(3 * f - 2 * index_fwd + index_bwd,
                                                           rel=1e-12)
  # routed experts enter at k/E: 3 matrices D×I per expert, k of them per token, every layer
  routed = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
  assert flops.routed_expert_params_per_token(cfg) == routed * cfg.num_hidden_layers
  # twice the experts, same k: only the router (D × E per layer) grows
  more = _cfg(n_routed_experts=16)
  assert flops.active_matrix_params(more) - flops.active_matrix_params(cfg) == (
      cfg.hidden_size * 8 * cfg.num_hidden_layers)


def test_matrices_and_train_flops_match_a_hand_count():
  """N and the train FLOPs of `_cfg`'s four layers counted by hand from the config and the spec
  (docs/design.md §3–§7), not from the parameter tree: the weight matrices only (no norm scales,
  mHC base/scale, attention sinks, Engram q_w/k_w), and the indexer's backward over the k
  selected entries (dq and dk of its KL loss), its forward over every visible entry."""
  cfg = _cfg()
  D, Q, H, Dh, O = (cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads, cfg.head_dim,
                    cfg.o_lora_rank)
  n, I, E, k = cfg.hc_mult, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
  HI, DI, T, W, K = (cfg.index_n_heads, cfg.index_head_dim, cfg.seq_len, cfg.sliding_window,
                     cfg.index_topk)
  every_layer = (D * Q + Q * H * Dh + D * Dh     # wq_a, wq_b, wkv
                 + H * Dh * O + O * cfg.o_groups * D  # wo_a (G groups of H·Dh/G → O), wo_b
                 + 2 * (2 + n) * n * n * D       # mHC fn of the attention and the FFN block
                 + D * E + 3 * D * I + k * 3 * D * I)  # router, shared expert, k routed experts
  compressor = {1: 2 * D * Dh, 2: D * Dh}        # Full m=2: wkv and wgate; Full m=1: wkv
  indexer = {1: Q * HI * DI + D * HI + Dh * DI,  # Full: wq_b, weights_proj, wk
             2: Q * HI * DI + D * HI + Dh * DI,
             3: Q * HI * DI + D * HI}            # Reindex: the Full layer's keys
  engram = len(cfg.engram_orders) * cfg.engram_n_heads * cfg.engram_head_dim * (n + 1) * D
  N = 4 * every_layer + sum(compressor.values()) + sum(indexer.values()) + engram + D * cfg.vocab_size
  assert flops.active_matrix_params(cfg) == N

  ratio = {0: 0, 1: 2, 2: 1, 3: 1}
  attention = index = 0.0
  for t in range(T):
    for layer, m in ratio.items():
      visible = (t + 1) // m if m else 0
      selected = min(K, visible)
      attention += 4 * H * Dh * (min(t + 1, W) + selected)
      if layer:
        index += 2 * HI * DI * visible + 4 * HI * DI * selected
  want = 3 * (2 * N + attention / T) + index / T
  np.testing.assert_allclose(flops.train_flops_per_token(cfg), want, rtol=1e-12)


def test_formula_matches_xla_cost_analysis_of_forward_backward():
  """XLA's flops of jax.grad(loss) vs train_flops_per_token × tokens, within 10 %.

  Apples to apples: one device, unrolled layers, no remat, expert buffers of exactly the routed
  rows; what remains beyond the formula is elementwise work, the masked global branch scoring all N
  entries, the block-local window and the indexer loss (see the flops.py docstring).
  """
  cfg = _cfg()
  B, T = 2, cfg.seq_len
  model = model_lib.init_model(cfg, seed=0)
  gdef, state = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(0)
  tok = rng.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  batch = dict(tokens=tok, targets=np.roll(tok, -1, 1), loss_mask=np.ones((B, T), bool),
               segment_ids=seg, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
               image_mask=np.zeros((B, T), bool))
  batch["engram_ids"] = inputs.engram_ids(cfg, tok, seg)
  bias = model_lib.zero_moe_bias(cfg)

  def loss(p):
    logits, aux = nnx.merge(gdef, p)(model_inputs(batch), bias)
    return objective(cfg, logits, aux, batch)[0]

  xla = xla_flops(jax.jit(jax.grad(loss)).lower(state).compile())
  assert (B * T * cfg.num_experts_per_tok) % cfg.n_routed_experts == 0  # C = n·k/E exactly
  formula = flops.train_flops_per_token(cfg) * B * T
  ratio = xla / formula
  print(f"xla {xla:.4g}, formula {formula:.4g}, ratio {ratio:.4f}")
  assert math.isfinite(ratio)
  # XLA counts at least the model's matmuls; the remainder is bounded by 10 %.
  assert 1.0 <= ratio < 1.10
