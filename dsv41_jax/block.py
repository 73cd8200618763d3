"""One transformer layer of the single-pass mHC stack (docs/design.md §3.3, §4–§8, §14).

A layer reads the n residual streams X and the previous site's pre-coefficients, injects Engram
memory (§7) when it is an Engram layer (the run looks the table up before its scan), runs attention with its CSA2 role from
the layer plan (Full: compress + index; Reindex: index the shared KV; Reuse: reuse the latest
top-k; SWA: window only), then the MoE, each through an mHC site:

  a_pre, a_post, a_comb = hc_attn(X)
  X = a_postᵀ·Attn(attn_norm(collapse(X, pre_mix))) + a_combᵀ X
  f_pre, f_post, f_comb = hc_ffn(X)
  X = f_postᵀ·MoE(ffn_norm(collapse(X, a_pre))) + f_combᵀ X ;   pre_mix ← f_pre

With `cfg.single_pass_boundary` the last line's write is deferred: the layer leaves f_post, f_comb
and the MoE output pending in its `StreamState`, and the next layer's attention site writes them
and reads its own coefficients and input in one single pass (`next_site`), as the MoE site does.

With `cfg.residual == "plain"` (the ablation baseline) there are no sites: one stream, pre_mix = 1
throughout (so collapse reads the stream as it is), and each sublayer adds its output,
X ← X + F(norm(X)) — the standard pre-norm residual.

Weights are split by what varies between layers: `LayerCore` holds what every layer has (the two
mHC sites and norms, attention, MoE) and `Publisher` what only Full / Reindex layers have (the
compressor and the indexer). `layer_forward` is the layer as a function of those weights, with the
CSA2 step chosen by the layer's kind, statically (`kind`) or inside a scan by `lax.switch`
(`kind_index`). What flows between layers is a `StreamState`; what every layer reads but never
changes is a `Context`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import LayerSpec
from dsv41_jax.layers import mhc
from dsv41_jax.layers.attention import Attention, selection_plan
from dsv41_jax.layers.compressor import Compressor
from dsv41_jax.layers.indexer import Indexer, indexer_kl_loss
from dsv41_jax.layers.moe import MoE
from dsv41_jax.layers.norm import RMSNorm
from dsv41_jax.layers.types import CompressedKV


class StreamState(NamedTuple):
  """The carry between layers: residual streams, pending pre-coefficients, shared CSA2 state.

  With `pending` = (F, post, comb) the streams are expand(X, post, comb, F): the last sublayer's
  output and its site's coefficients, not yet written into X (`defer_output`); the next layer
  writes them in its attention site's single pass, `settle` before anything else reads X."""

  X_BxTxNxD: jax.Array
  pre_mix_BxTxN: jax.Array
  kv: CompressedKV | None = None        # the latest Full layer's compressed KV
  topk_BxTxK: jax.Array | None = None   # the latest Full/Reindex layer's selection
  candidate: Any = None                 # the hierarchical candidate pool, when enabled
  attn_plan: Any = None                 # the attention op's plan of that selection, or None
  pending: Any = None                   # (F [B,T,D], post [B,T,n], comb [B,T,n,n]) or None


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


class LayerCore(nnx.Module):
  """The weights every layer has: `attn_hc`, `ffn_hc` (mHC only), `attn_norm`, `ffn_norm`, `attn`,
  `moe`.

  `spec` only fixes the RoPE frequencies, which a run's layers share (same compression ratio).
  """

  def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
    d = cfg.hidden_size
    if cfg.residual == "mhc":
      self.attn_hc = mhc.MHCSite(cfg, rngs)
      self.ffn_hc = mhc.MHCSite(cfg, rngs)
    self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, rngs)
    self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps, rngs)
    self.attn = Attention(cfg, spec, rngs)
    self.moe = MoE(cfg, rngs)


class Publisher(nnx.Module):
  """A Full layer's `compressor` and `indexer`, or a Reindex layer's `indexer`."""

  def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
    if not spec.owns_indexer:
      raise ValueError(f"layer {spec.index} is a {spec.mode} layer; it publishes nothing")
    if spec.owns_compressor:
      self.compressor = Compressor(cfg, spec, rngs)
    self.indexer = Indexer(cfg, spec, rngs, query_chunk=cfg.index_query_chunk)


def site_coefficients(cfg: ModelConfig, site: str, core: LayerCore, X_BxTxNxD: jax.Array,
                      pre_in_BxTxN: jax.Array):
  """(pre, post, comb) of the layer's `site` ("attn_hc" / "ffn_hc") on the streams X; with the
  plain residual (no sites) (pre_in, None, None): the next collapse reads as this one did."""
  if cfg.residual == "plain":
    return pre_in_BxTxN, None, None
  return getattr(core, site)(X_BxTxNxD)


def site_output(X_BxTxNxD: jax.Array, post_BxTxN, comb_BxTxNxN, f_out_BxTxD: jax.Array
                ) -> jax.Array:
  """The streams after a sublayer: `mhc.expand(X, post, comb, F)`, or X + F for the plain residual
  (post None), in float32, X's dtype out."""
  if post_BxTxN is None:
    out = X_BxTxNxD.astype(jnp.float32) + f_out_BxTxD.astype(jnp.float32)[..., None, :]
    return out.astype(X_BxTxNxD.dtype)
  return mhc.expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, f_out_BxTxD)


def site_input(cfg: ModelConfig, norm: RMSNorm, X_BxTxNxD: jax.Array, pre_BxTxN: jax.Array
               ) -> jax.Array:
  """A sublayer's input read from the streams: norm(collapse(X, pre)) in the compute dtype."""
  return norm(mhc.collapse(X_BxTxNxD, pre_BxTxN)).astype(cfg.dtype)


def next_site(cfg: ModelConfig, site: str, norm: RMSNorm, core: LayerCore, X_BxTxNxD: jax.Array,
              f_out_BxTxD: jax.Array, post_BxTxN, comb_BxTxNxN, pre_BxTxN):
  """A sublayer's output written into the streams and the layer's next `site` read from them, as
  one single-pass site (§3.3; the op `hc_site`): (X', x, pre', post', comb') with
  X' = expand(X, post, comb, F), x = norm(collapse(X', pre)) in the compute dtype and this site's
  coefficients on X'. The plain residual: X' = X + F, x = norm(X'), (pre, None, None)."""
  if cfg.residual == "plain":
    X = site_output(X_BxTxNxD, None, None, f_out_BxTxD)
    return X, site_input(cfg, norm, X, pre_BxTxN), pre_BxTxN, None, None
  X, x, pre, post, comb = getattr(core, site).site(X_BxTxNxD, f_out_BxTxD, post_BxTxN,
                                                   comb_BxTxNxN, pre_BxTxN, norm.scale[...])
  return X, x.astype(cfg.dtype), pre, post, comb


def settle(state: StreamState) -> StreamState:
  """The state with its pending sublayer output written into X (`site_output`); as it is when
  nothing is pending."""
  if state.pending is None:
    return state
  F, post, comb = state.pending
  X = site_output(state.X_BxTxNxD, post, comb, F).astype(state.X_BxTxNxD.dtype)
  return state._replace(X_BxTxNxD=X, pending=None)


def defer_output(cfg: ModelConfig, state: StreamState) -> StreamState:
  """The state with an identity pending output (F = 0, post = 0, comb = I: expand gives X back
  exactly), so that a run's layers write each MoE output in the next layer's attention site
  (`ModelConfig.single_pass_boundary`); as it is when something is pending already."""
  if state.pending is not None:
    return state
  B, T, n, d = state.X_BxTxNxD.shape
  dt = state.pre_mix_BxTxN.dtype      # the coefficients' dtype (float32; a float64 program's own)
  return state._replace(pending=(
      jnp.zeros((B, T, d), cfg.dtype), jnp.zeros((B, T, n), dt),
      jnp.broadcast_to(jnp.eye(n, dtype=dt), (B, T, n, n))))


def _compressed_kv(core: LayerCore, pub: Publisher, src_BxTxD, ctx: Context) -> CompressedKV:
  inv_freq = core.attn.inv_freq
  main_kv, latent, seg, last, pos = pub.compressor(src_BxTxD, ctx.positions_BxT,
                                                   ctx.segment_ids_BxT, inv_freq)
  return CompressedKV(main_kv, pub.indexer.keys(latent, pos, inv_freq), seg, last, pos)


def encoder_final_input(cfg: ModelConfig, core: LayerCore, enc: StreamState) -> jax.Array:
  """The compressor input of a decoder KV source that projects from the final encoder state."""
  return site_input(cfg, core.attn_norm, enc.X_BxTxNxD, enc.pre_mix_BxTxN)


def prefill_kv(cfg: ModelConfig, core: LayerCore, pub: Publisher, enc: StreamState,
               ctx: Context) -> CompressedKV:
  """The compressed KV a decoder Full layer builds from the final encoder state (§6)."""
  return _compressed_kv(core, pub, encoder_final_input(cfg, core, enc), ctx)


# Remat names (`dsv41_jax.model.remat_policy` keeps them): the attention op's plan of a selection.
ATTENTION_PLAN = "attention_plan"


def _publish(cfg: ModelConfig, spec: LayerSpec, core: LayerCore, pub: Publisher | None,
             x, c_q, state: StreamState, ctx: Context):
  """The CSA2 step of one kind: (kv, topk, candidate, scores_at_topk or zeros, attention plan).
  A layer that selects makes the attention op's plan of its selection (`selection_plan`), which
  its attention and the Reuse layers after it share."""
  kv, topk, candidate, plan = state.kv, state.topk_BxTxK, state.candidate, state.attn_plan
  scores = jnp.zeros(topk.shape, jnp.float32)
  if spec.owns_compressor:
    src = x
    if spec.kv_input == "encoder_final":
      src = encoder_final_input(cfg, core, ctx.encoder_final)
    kv = _compressed_kv(core, pub, src, ctx)
  if spec.owns_indexer:
    topk, scores, cand_out = pub.indexer(
        x, c_q, positions=ctx.positions_BxT, segment_ids=ctx.segment_ids_BxT, kv=kv,
        candidate=candidate if spec.candidate_role == "consumer" else None)
    if spec.candidate_role == "source":
      candidate = cand_out
    plan = checkpoint_name(selection_plan(cfg, kv, topk, ctx.segment_ids_BxT), ATTENTION_PLAN)
  return kv, topk, candidate, scores, plan


def publish(cfg: ModelConfig, kinds: Sequence[LayerSpec], core: LayerCore,
            pubs: Sequence[Publisher | None], x, c_q, state: StreamState, ctx: Context, kind_index):
  """The layer's CSA2 step (`_publish` of its kind; a `lax.switch` over the kinds when there are
  several and `kind_index` is traced)."""
  branches = [
      (lambda x, c_q, state, spec=spec, pub=pub: _publish(cfg, spec, core, pub, x, c_q, state, ctx))
      for spec, pub in zip(kinds, pubs)]
  if len(branches) == 1:
    return branches[0](x, c_q, state)
  return jax.lax.switch(kind_index, branches, x, c_q, state)


def attend(core: LayerCore, x_BxTxD, c_q, ctx: Context, kv=None, topk_BxTxK=None, plan=None):
  """The layer's attention on its input x: (output, global probabilities); the sliding window
  only when `kv` is None. Its own function so that a profile names the op's work attention's
  (a custom VJP's operations carry their caller's source line, benchmarks/gpu_profile.py)."""
  y, _, global_probs = core.attn(
      x_BxTxD, positions_BxT=ctx.positions_BxT, segment_ids_BxT=ctx.segment_ids_BxT, kv=kv,
      topk_BxTxK=topk_BxTxK, c_q_BxTxQ=c_q, plan=plan)
  return y, global_probs


def indexer_loss(kinds: Sequence[LayerSpec], kind_index, scores, topk_BxTxK, global_probs,
                 real_BxT) -> jax.Array:
  """The indexer's KL loss against the attention's global probabilities (held fixed) for a layer
  whose kind owns an indexer; zero for the others (a `lax.switch` over traced kinds)."""
  owns = [spec.owns_indexer for spec in kinds]
  kl = lambda: indexer_kl_loss(scores, topk_BxTxK, jax.lax.stop_gradient(global_probs), real_BxT)
  if all(owns):
    return kl()
  if any(owns):
    return jax.lax.switch(kind_index, [kl if o else (lambda: jnp.zeros((), jnp.float32))
                                       for o in owns])
  return jnp.zeros((), jnp.float32)


def layer_forward(cfg: ModelConfig, kinds: Sequence[LayerSpec], core: LayerCore,
                  pubs: Sequence[Publisher | None], state: StreamState, ctx: Context,
                  moe_bias_2xE: jax.Array, kind_index=0) -> tuple[StreamState, LayerAux]:
  """One layer. `kinds[kind_index]` is its kind; `pubs[k]` the Publisher for kind k (None for
  kinds that publish nothing). With one kind the CSA2 step is static; with several,
  `kind_index` may be traced and the step is a `lax.switch` over the kinds. An Engram layer's
  injection comes before, on the streams it is given (the caller's: the model injects before the
  run the layer starts, decode before the layer); its aux `engram_gate_N` is zeros here.

  With a `pending` output in `state` (`defer_output`), the attention site is one single pass
  (`next_site`: the previous MoE output written, this site's coefficients and input read) and
  the layer leaves its own MoE output pending; the same values as writing it here and reading
  the site apart (`ModelConfig.single_pass_boundary`)."""
  X = state.X_BxTxNxD
  real = ctx.segment_ids_BxT > 0
  gate = jnp.zeros((cfg.hc_mult,), jnp.float32)
  global_branch = kinds[0].reads_global_kv    # one compression ratio per run: all or none

  # --- attention site: the previous MoE output written here when it is pending ---
  if state.pending is None:
    a_pre, a_post, a_comb = site_coefficients(cfg, "attn_hc", core, X, state.pre_mix_BxTxN)
    x = site_input(cfg, core.attn_norm, X, state.pre_mix_BxTxN)
  else:
    F, post, comb = state.pending
    X, x, a_pre, a_post, a_comb = next_site(cfg, "attn_hc", core.attn_norm, core, X, F, post,
                                            comb, state.pre_mix_BxTxN)
  c_q = core.attn.q_latent(x)
  kv, topk, candidate, plan = state.kv, state.topk_BxTxK, state.candidate, state.attn_plan
  if global_branch:
    kv, topk, candidate, scores, plan = publish(cfg, kinds, core, pubs, x, c_q, state, ctx,
                                                kind_index)
    y, global_probs = attend(core, x, c_q, ctx, kv, topk, plan)
    idx_loss = indexer_loss(kinds, kind_index, scores, topk, global_probs, real)
  else:
    y, _ = attend(core, x, c_q, ctx)
    idx_loss = jnp.zeros((), jnp.float32)

  # --- MoE site: the attention output written, the MoE input read, in one single-pass site ---
  X, x, f_pre, f_post, f_comb = next_site(cfg, "ffn_hc", core.ffn_norm, core, X, y, a_post,
                                          a_comb, a_pre)
  y, moe_aux = core.moe(x, segment_ids_BxT=ctx.segment_ids_BxT,
                        image_mask_BxT=ctx.image_mask_BxT, bias_2xE=moe_bias_2xE)
  if state.pending is None:
    X, pending = site_output(X, f_post, f_comb, y), None
  else:       # written by the next layer's attention site, or by `settle`
    pending = (y.astype(cfg.dtype), f_post, f_comb)

  new_state = StreamState(X.astype(state.X_BxTxNxD.dtype), f_pre, kv, topk, candidate, plan,
                          pending)
  aux = LayerAux(moe_aux["balance_loss"], idx_loss, moe_aux["load_2xE"],
                 moe_aux["dropped_fraction"], gate, jnp.zeros((), jnp.float32))
  return new_state, aux
