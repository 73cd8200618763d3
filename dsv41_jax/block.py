"""One transformer layer of the single-pass mHC stack (MODEL.md §3.3, §4–§8, §14).

A layer reads the n residual streams X and the previous site's pre-coefficients, optionally injects
Engram memory (§7), runs attention with its CSA2 role from the layer plan (Full: compress + index;
Reindex: index the shared KV; Reuse: reuse the latest top-k; SWA: window only), then the MoE, each
through an mHC site:

  a_pre, a_post, a_comb = hc_attn(X)
  X = a_postᵀ·Attn(attn_norm(collapse(X, pre_mix))) + a_combᵀ X
  f_pre, f_post, f_comb = hc_ffn(X)
  X = f_postᵀ·MoE(ffn_norm(collapse(X, a_pre))) + f_combᵀ X ;   pre_mix ← f_pre

What flows between layers is a `StreamState`; what every layer reads but never changes is a
`Context`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import LayerSpec
from dsv41_jax.layers import mhc
from dsv41_jax.layers.attention import Attention
from dsv41_jax.layers.compressor import Compressor
from dsv41_jax.layers.engram import Engram
from dsv41_jax.layers.indexer import Indexer, indexer_kl_loss
from dsv41_jax.layers.moe import MoE
from dsv41_jax.layers.norm import RMSNorm
from dsv41_jax.layers.rope import layer_inv_freq
from dsv41_jax.layers.types import CompressedKV


class StreamState(NamedTuple):
  """The carry between layers: residual streams, pending pre-coefficients, shared CSA2 state."""

  X_BxTxNxD: jax.Array
  pre_mix_BxTxN: jax.Array
  kv: CompressedKV | None = None        # the latest Full layer's compressed KV
  topk_BxTxK: jax.Array | None = None   # the latest Full/Reindex layer's selection
  candidate: Any = None                 # the hierarchical candidate pool, when enabled


@dataclasses.dataclass(frozen=True)
class Context:
  """Per-batch inputs every layer reads."""

  positions_BxT: jax.Array
  segment_ids_BxT: jax.Array
  image_mask_BxT: jax.Array
  engram_ids: dict[int, jax.Array]          # layer id -> [B, T, H] global table rows
  encoder_final: StreamState | None = None  # for kv_input == "encoder_final"


jax.tree_util.register_dataclass(
    Context, data_fields=["positions_BxT", "segment_ids_BxT", "image_mask_BxT", "engram_ids",
                          "encoder_final"], meta_fields=[])


class LayerAux(NamedTuple):
  """Per-layer outputs for losses and logs (scalars and small arrays)."""

  balance_loss: jax.Array
  indexer_loss: jax.Array
  load_2xE: jax.Array
  dropped_fraction: jax.Array
  engram_gate_N: jax.Array       # mean gate per stream (zeros where the layer has no Engram)
  engram_rows_touched: jax.Array  # fraction of table rows touched (0 without Engram)


class Block(nnx.Module):
  """One layer; its sub-modules follow its `LayerSpec` (parameter names in optim's table)."""

  def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
    self.cfg, self.spec = cfg, spec
    d = cfg.hidden_size
    self.attn_hc = mhc.MHCSite(cfg, rngs)
    self.ffn_hc = mhc.MHCSite(cfg, rngs)
    self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, rngs)
    self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps, rngs)
    self.attn = Attention(cfg, spec, rngs)
    if spec.mode == "full":
      self.compressor = Compressor(cfg, spec, rngs)
    if spec.mode in ("full", "reindex"):
      self.indexer = Indexer(cfg, spec, rngs, query_chunk=cfg.index_query_chunk)
    self.moe = MoE(cfg, rngs)
    if spec.engram:
      self.engram = Engram(cfg, spec.index, rngs=rngs, fp8_table=cfg.engram_fp8_table)

  def __call__(self, state: StreamState, ctx: Context, moe_bias_2xE: jax.Array
               ) -> tuple[StreamState, LayerAux]:
    cfg, spec = self.cfg, self.spec
    X = state.X_BxTxNxD
    real = ctx.segment_ids_BxT > 0
    n = cfg.hc_mult
    gate = jnp.zeros((n,), jnp.float32)
    touched = jnp.zeros((), jnp.float32)
    if spec.engram:
      token_mask = real & ~ctx.image_mask_BxT
      X, stats = self.engram(X, ctx.engram_ids[spec.index], token_mask)
      gate, touched = stats["gate_mean"], stats["rows_touched_frac"]

    # --- attention site ---
    a_pre, a_post, a_comb = self.attn_hc(X)
    x = self.attn_norm(mhc.collapse(X, state.pre_mix_BxTxN)).astype(cfg.dtype)
    inv_freq = layer_inv_freq(cfg, spec)
    kv, topk, candidate = state.kv, state.topk_BxTxK, state.candidate
    c_q = self.attn.q_latent(x)
    scores = None
    if spec.mode == "full":
      src = x
      if spec.kv_input == "encoder_final":
        enc = ctx.encoder_final
        src = self.attn_norm(mhc.collapse(enc.X_BxTxNxD, enc.pre_mix_BxTxN)).astype(cfg.dtype)
      main_kv, latent, seg, last, pos = self.compressor(src, ctx.positions_BxT, ctx.segment_ids_BxT,
                                                        inv_freq)
      index_k = self.indexer.keys(latent, pos, inv_freq)
      kv = CompressedKV(main_kv, index_k, seg, last, pos)
    if spec.mode in ("full", "reindex"):
      topk, scores, cand_out = self.indexer(
          x, c_q, positions=ctx.positions_BxT, segment_ids=ctx.segment_ids_BxT, kv=kv,
          candidate=candidate if spec.candidate_role == "consumer" else None)
      if spec.candidate_role == "source":
        candidate = cand_out
    y, _, global_probs = self.attn(
        x, positions_BxT=ctx.positions_BxT, segment_ids_BxT=ctx.segment_ids_BxT,
        kv=kv if spec.mode != "swa" else None, topk_BxTxK=topk if spec.mode != "swa" else None,
        c_q_BxTxQ=c_q)
    if scores is not None:
      idx_loss = indexer_kl_loss(scores, topk, jax.lax.stop_gradient(global_probs), real)
    else:
      idx_loss = jnp.zeros((), jnp.float32)
    X = mhc.expand(X, a_post, a_comb, y)

    # --- MoE site ---
    f_pre, f_post, f_comb = self.ffn_hc(X)
    x = self.ffn_norm(mhc.collapse(X, a_pre)).astype(cfg.dtype)
    y, moe_aux = self.moe(x, segment_ids_BxT=ctx.segment_ids_BxT,
                          image_mask_BxT=ctx.image_mask_BxT, bias_2xE=moe_bias_2xE)
    X = mhc.expand(X, f_post, f_comb, y)

    new_state = StreamState(X.astype(state.X_BxTxNxD.dtype), f_pre, kv, topk, candidate)
    aux = LayerAux(moe_aux["balance_loss"], idx_loss, moe_aux["load_2xE"],
                   moe_aux["dropped_fraction"], gate, touched)
    return new_state, aux

  def prefill_kv(self, enc: StreamState, ctx: Context) -> CompressedKV:
    """The compressed KV this decoder Full layer builds from the final encoder state (§6)."""
    cfg, spec = self.cfg, self.spec
    inv_freq = layer_inv_freq(cfg, spec)
    src = self.attn_norm(mhc.collapse(enc.X_BxTxNxD, enc.pre_mix_BxTxN)).astype(cfg.dtype)
    main_kv, latent, seg, last, pos = self.compressor(src, ctx.positions_BxT, ctx.segment_ids_BxT,
                                                      inv_freq)
    return CompressedKV(main_kv, self.indexer.keys(latent, pos, inv_freq), seg, last, pos)


class Unit(nnx.Module):
  """The layers of one unit of a segment (a publisher layer and its Reuse followers)."""

  def __init__(self, cfg: ModelConfig, specs: tuple[LayerSpec, ...], rngs: nnx.Rngs):
    self.layers = nnx.List([Block(cfg, s, rngs) for s in specs])

  def __call__(self, state: StreamState, ctx: Context, moe_bias_Ux2xE: jax.Array):
    auxes = []
    for j, layer in enumerate(self.layers):
      state, aux = layer(state, ctx, moe_bias_Ux2xE[j])
      auxes.append(aux)
    return state, jax.tree.map(lambda *a: jnp.stack(a), *auxes)
