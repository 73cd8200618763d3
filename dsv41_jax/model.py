"""The whole DeepSeek-V4.1-Flash backbone: embedding, the plan-driven layer stack, head (MODEL.md).

Layers are grouped by the layer plan into segments of identical units (`layer_plan.Segment`); each
segment's units have their parameters stacked on a leading axis and run under one `lax.scan`, so
compile time and program size do not grow with depth. A forward pass can stop after the encoder
(CED prefill, §6).

Shapes: B batch, T sequence, N = hc_mult streams, D hidden, V vocab, L layers, E experts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.block import Context, LayerAux, StreamState, Unit
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import LayerPlan, Segment, build_layer_plan
from dsv41_jax.layers import mhc
from dsv41_jax.layers.norm import RMSNorm
from dsv41_jax.layers.types import CompressedKV


def _stacked_unit(cfg: ModelConfig, seg: Segment, rngs: nnx.Rngs) -> Unit:
  """`seg.repeats` units with parameters stacked on a leading axis (one unit if repeats == 1)."""
  if seg.repeats == 1:
    return Unit(cfg, seg.unit, rngs)

  @nnx.split_rngs(splits=seg.repeats)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(r: nnx.Rngs) -> Unit:
    return Unit(cfg, seg.unit, r)

  return make(rngs)


class Transformer(nnx.Module):
  """Embedding → segments of scanned units → final collapse, norm and head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.plan: LayerPlan = build_layer_plan(cfg)
    pd = jnp.dtype(cfg.param_dtype)
    self.embed = sharding.param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                sharding.normal(1.0), pd)
    self.segments = nnx.List([_stacked_unit(cfg, s, rngs) for s in self.plan.segments])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs)
    self.head = sharding.param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                               sharding.fan_in_normal((0,)), pd)
    if cfg.vision is not None:  # the vision pathway (dsv41_jax/vision), params vision/, projector/
      from dsv41_jax.vision.projector import Projector
      from dsv41_jax.vision.vit import ViT
      self.vision = ViT(cfg.vision, rngs, dtype=cfg.dtype, param_dtype=pd)
      self.projector = Projector(cfg.vision, cfg.hidden_size, rngs, dtype=cfg.dtype, param_dtype=pd)

  # --- pieces -------------------------------------------------------------------------------

  def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
    cfg = self.cfg
    h = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cfg.dtype)
    return sharding.constrain(h, ("batch", "seq", "embed"))

  def initial_state(self, h_BxTxD: jax.Array) -> StreamState:
    """X⁰ = the embedding broadcast to every stream; pre_mix = e_0 (MODEL.md §3.3)."""
    n = self.cfg.hc_mult
    B, T, D = h_BxTxD.shape
    X = jnp.broadcast_to(h_BxTxD[:, :, None, :], (B, T, n, D)).astype(jnp.float32)
    pre = jnp.broadcast_to(mhc.initial_pre(n), (B, T, n)).astype(jnp.float32)
    return StreamState(X, pre)

  def run_segment(self, s: int, state: StreamState, ctx: Context,
                  moe_bias_Lx2xE: jax.Array) -> tuple[StreamState, LayerAux]:
    """Run segment `s`; returns the new state and per-layer aux stacked in layer order."""
    cfg = self.cfg
    seg = self.plan.segments[s]
    unit_module = self.segments[s]
    lo, hi = seg.first_layer, seg.first_layer + seg.unit_len * seg.repeats
    bias = moe_bias_Lx2xE[lo:hi].reshape(seg.repeats, seg.unit_len, *moe_bias_Lx2xE.shape[1:])
    state = self._prepare_carry(seg, state, ctx)

    def body(carry, xs):
      unit_state, bias_u = xs
      unit = nnx.merge(graphdef, unit_state)
      return unit(carry, ctx, bias_u)

    if cfg.remat:
      body = jax.checkpoint(body, prevent_cse=False)
    graphdef, params = nnx.split(unit_module)
    if seg.repeats == 1:
      state, aux = body(state, (params, bias[0]))
      aux = jax.tree.map(lambda a: a[None], aux)
    elif cfg.scan_layers:
      state, aux = jax.lax.scan(body, state, (params, bias))
    else:
      auxes = []
      for r in range(seg.repeats):
        state, a = body(state, jax.tree.map(lambda p: p[r], (params, bias)))
        auxes.append(a)
      aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    # [repeats, unit_len, ...] -> [layers, ...]
    aux = jax.tree.map(lambda a: a.reshape(seg.repeats * seg.unit_len, *a.shape[2:]), aux)
    return state, aux

  def _prepare_carry(self, seg: Segment, state: StreamState, ctx: Context) -> StreamState:
    """Give the carry the CSA2 fields a segment's units produce, so scan sees a fixed structure."""
    cfg = self.cfg
    first = seg.unit[0]
    if first.mode == "swa":
      return state
    B, T = ctx.segment_ids_BxT.shape
    m = first.compress_ratio
    n_entries = -(-T // m)
    kv, topk, cand = state.kv, state.topk_BxTxK, state.candidate
    if kv is None or kv.main_kv_BxNxD.shape[1] != n_entries:
      if first.mode != "full":
        raise ValueError(f"layer {first.index} ({first.mode}) has no compressed KV to read")
      dt = jnp.dtype(cfg.dtype)
      kv = CompressedKV(
          jnp.zeros((B, n_entries, cfg.head_dim), dt),
          jnp.zeros((B, n_entries, cfg.index_head_dim), dt),
          jnp.full((B, n_entries), -1, jnp.int32), jnp.zeros((B, n_entries), jnp.int32),
          jnp.zeros((B, n_entries), jnp.int32))
      topk = None
    if topk is None:
      topk = jnp.full((B, T, min(cfg.index_topk, n_entries)), -1, jnp.int32)
    if cand is None and any(l.candidate_role == "source" for l in seg.unit):
      cand = self._empty_candidate(B, T, n_entries)
    return StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN, kv, topk, cand)

  def _empty_candidate(self, B: int, T: int, n_entries: int):
    from dsv41_jax.layers.indexer import empty_candidate
    return empty_candidate(self.cfg, B, T, n_entries)

  # --- forward ------------------------------------------------------------------------------

  def __call__(self, batch: dict[str, jax.Array], moe_bias_Lx2xE: jax.Array, *,
               stop_after_encoder: bool = False,
               input_embeddings_BxTxD: jax.Array | None = None,
               train_vit: bool = True) -> tuple[jax.Array, dict[str, Any]]:
    """Logits [B, T, V] (or, with `stop_after_encoder`, the prefill dict) and aux.

    `batch` holds `tokens`, `positions`, `segment_ids` ([B, T] int32), optionally `image_mask`
    (bool) and `engram_ids` (dict layer → [B, T, H] int32 rows from `dsv41_jax.engram`).
    `input_embeddings_BxTxD` replaces the token embedding. Otherwise, with `cfg.vision` set and
    `images`, `image_cells`, `image_starts`, `image_count` in the batch (`data/packing.py`), the
    image spans get the vision pathway's embeddings (`dsv41_jax.vision.pathway`); `train_vit=False`
    (static) keeps every gradient out of the ViT while it is frozen.
    """
    cfg = self.cfg
    tokens = batch["tokens"]
    ctx = Context(batch["positions"].astype(jnp.int32), batch["segment_ids"].astype(jnp.int32),
                  batch.get("image_mask", jnp.zeros(tokens.shape, bool)).astype(bool),
                  dict(batch.get("engram_ids", {})))
    h = self.embed_tokens(tokens) if input_embeddings_BxTxD is None else input_embeddings_BxTxD
    if input_embeddings_BxTxD is None and cfg.vision is not None and "images" in batch:
      from dsv41_jax.vision.pathway import embed_with_images
      h = embed_with_images(self.vision, self.projector, h, batch, train_vit=train_vit)
    state = self.initial_state(h)
    auxes = []
    n_enc = self.plan.num_encoder_layers
    for s, seg in enumerate(self.plan.segments):
      if seg.first_layer == n_enc:
        enc_state = StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN)
        if stop_after_encoder:
          return self._prefill_outputs(enc_state, ctx), _collect(auxes)
        # The decoder reads its own compressed KV, never the encoder's.
        state = enc_state
        ctx = Context(ctx.positions_BxT, ctx.segment_ids_BxT, ctx.image_mask_BxT, ctx.engram_ids,
                      encoder_final=enc_state if cfg.kv_source_input == "encoder_final" else None)
      state, aux = self.run_segment(s, state, ctx, moe_bias_Lx2xE)
      auxes.append(aux)
    x = self.final_norm(mhc.collapse(state.X_BxTxNxD, state.pre_mix_BxTxN)).astype(cfg.dtype)
    logits = jnp.einsum("btd,dv->btv", x, self.head[...].astype(cfg.dtype),
                        preferred_element_type=jnp.float32)
    return logits, _collect(auxes)

  def _prefill_outputs(self, enc: StreamState, ctx: Context) -> dict[str, Any]:
    """H_{L/2} and the decoder KV sources that project from it (MODEL.md §6): the first decoder
    layer when it is a Full layer (its attention input is H_{L/2}) and every Full layer whose
    `kv_input` is "encoder_final"."""
    n_enc = self.plan.num_encoder_layers
    out: dict[str, Any] = {"encoder_state": enc, "decoder_kv": {}}
    for s, seg in enumerate(self.plan.segments):
      for r in range(seg.repeats):
        for j, spec in enumerate(seg.unit):
          layer_id = seg.first_layer + r * seg.unit_len + j
          if spec.mode != "full" or spec.is_encoder or not (
              spec.kv_input == "encoder_final" or layer_id == n_enc):
            continue
          unit = self.segments[s]
          if seg.repeats > 1:
            g, p = nnx.split(unit)
            unit = nnx.merge(g, jax.tree.map(lambda a: a[r], p))
          out["decoder_kv"][layer_id] = unit.layers[j].prefill_kv(enc, ctx)
    return out


def _collect(auxes: list[LayerAux]) -> dict[str, jax.Array]:
  if not auxes:
    return {}
  aux = jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)
  return aux._asdict()


# --- construction helpers ---------------------------------------------------------------------

def zero_moe_bias(cfg: ModelConfig) -> jax.Array:
  """The routing bias [L, 2 (text, image), E]: not a parameter, updated by the train loop."""
  return jnp.zeros((cfg.num_hidden_layers, 2, cfg.n_routed_experts), jnp.float32)


def abstract_model(cfg: ModelConfig) -> Transformer:
  """The model with ShapeDtypeStruct leaves: no allocation (for the ledger and sharding plans)."""
  return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))


def abstract_params(cfg: ModelConfig) -> nnx.State:
  """The parameter `nnx.State` of the model, as ShapeDtypeStructs."""
  return nnx.state(abstract_model(cfg), nnx.Param)


def init_model(cfg: ModelConfig, seed: int = 0, mesh: jax.sharding.Mesh | None = None
               ) -> Transformer:
  """Initialise the model; with a mesh, every parameter is created directly with its sharding."""
  if mesh is None:
    return Transformer(cfg, nnx.Rngs(seed))
  gdef, abs_state = nnx.split(abstract_model(cfg))
  shardings = sharding.state_shardings(abs_state, mesh)
  state = jax.jit(lambda: nnx.split(Transformer(cfg, nnx.Rngs(seed)))[1],
                  out_shardings=shardings)()
  return nnx.merge(gdef, state)


def param_count(state: nnx.State) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
