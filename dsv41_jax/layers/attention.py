"""The attention of every layer (docs/design.md §4.1–4.4; packed rows §14): weights and their wiring.

Shapes (B batch, T tokens, d hidden, Q q_lora_rank, H heads, D head_dim, r qk_rope_head_dim,
G o_groups, O o_lora_rank, N compressed entries, K top-k slots):

  c_q = RMSNorm_w(x @ wq_a)                     [B,T,d] → [B,T,Q]       (also feeds the indexer)
  q   = c_q @ wq_b                              [B,T,Q] → [B,T,H,D]     wq_b stored [Q, H, D]
  q   ← q · rsqrt(mean(q², −1) + eps)           per head, unweighted, only if cfg.q_head_norm
  q[..., −r:] = RoPE(q[..., −r:], positions)
  kv  = RMSNorm_w(x @ wkv)                      [B,T,d] → [B,T,D]       K = V, one head
  kv[..., −r:] = RoPE(kv[..., −r:], positions);  kv = FakeQuantFP8(kv) if cfg.fp8_swa_kv
  o   = attend(q, kv, window ∪ top-k entries, sink)      [B,T,H,D]      (op `sparse_attention`)
  o[..., −r:] = RoPE⁻¹(o[..., −r:], positions)           de-rotate by the query position
  u_g = o.reshape(B,T,G,(H/G)·D)[g] @ wo_a[g]   [B,T,G,(H/G)·D] → [B,T,G,O]
  y   = concat_g(u_g) @ wo_b                    [B,T,G·O] → [B,T,d]

Compute in `cfg.dtype`, parameters in `cfg.param_dtype`, scores and softmax in float32.
All RoPE of the layer uses `layer_inv_freq(cfg, spec)` (docs/design.md §4.5) at the packed `positions`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.layers.norm import RMSNorm, rms_norm
from dsv41_jax.layers.rope import apply_rope, layer_inv_freq
from dsv41_jax.layers.types import CompressedKV
from pallas_kernels import dispatch
from pallas_kernels.ops.sparse_attention import default_scale


def visible_topk(topk_BxTxK: jax.Array, kv: CompressedKV, segment_ids_BxT: jax.Array) -> jax.Array:
  """`topk` with every slot naming an entry invisible to its query (docs/design.md §5.2, §14) set to −1.

  The indexer already selects only visible entries; re-checking the K selected slots (O(B·T·K))
  keeps attention causal and document-local whatever top-k it is handed.
  """
  idx = jnp.maximum(topk_BxTxK, 0)
  take = lambda a_BxN: jnp.take_along_axis(a_BxN[:, None, :], idx, axis=-1)  # [B, T, K]
  t = jnp.arange(topk_BxTxK.shape[1], dtype=jnp.int32)[None, :, None]
  seg = segment_ids_BxT[:, :, None]
  ok = ((topk_BxTxK >= 0) & (take(kv.entry_last_BxN) <= t)
        & (take(kv.entry_segment_BxN) == seg) & (seg > 0))
  return jnp.where(ok, topk_BxTxK, -1)


def op_static(cfg) -> dict:
  """The sparse-attention op's static arguments for this config."""
  return dict(window=cfg.sliding_window, scale=default_scale(cfg.head_dim),
              impl=cfg.global_attn_impl, query_chunk=cfg.attn_query_chunk or None)


def selection_plan(cfg, kv: CompressedKV, topk_BxTxK: jax.Array, segment_ids_BxT: jax.Array):
  """The sparse-attention op's plan of one selection, or None (`dispatch.make_plan`): what its
  kernel derives from top-k alone (the backward's slot order), made once by the layer that
  publishes the top-k and passed to its attention and its Reuse layers' (docs/design.md §5.5,
  §T5). The op's other arguments enter by shape only, the shapes `Attention.__call__` gives."""
  B, T = segment_ids_BxT.shape
  dt = jnp.dtype(cfg.dtype)
  H, D = cfg.num_attention_heads, cfg.head_dim
  sd = jax.ShapeDtypeStruct
  _, plan = dispatch.make_plan(
      "sparse_attention", cfg.ops.sparse_attention, sd((B, T, H, D), dt), sd((B, T, D), dt),
      segment_ids_BxT, sd((H,), jnp.float32), sd(kv.main_kv_BxNxD.shape, dt),
      visible_topk(topk_BxTxK, kv, segment_ids_BxT), **op_static(cfg))
  return plan


class Attention(nnx.Module):
  """Query path, SWA KV, sparse attention with sink, de-rotation and grouped output projection."""

  def __init__(self, cfg, spec, rngs: nnx.Rngs):
    self.cfg = cfg
    self.spec = spec
    d, Q, H, D = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads, cfg.head_dim
    G, O = cfg.o_groups, cfg.o_lora_rank
    pd = jnp.dtype(cfg.param_dtype)
    p = sharding.param
    self.wq_a = p(rngs, (d, Q), ("embed", "q_lora"), sharding.fan_in_normal((0,)), pd)
    self.q_norm = RMSNorm(Q, cfg.rms_norm_eps, rngs, pd)
    # Stored per head so head-wise Muon can orthogonalise each [Q, D] slice.
    self.wq_b = p(rngs, (Q, H, D), ("q_lora", "heads", "head_dim"), sharding.fan_in_normal((0,)), pd)
    self.wkv = p(rngs, (d, D), ("embed", "kv"), sharding.fan_in_normal((0,)), pd)
    self.kv_norm = RMSNorm(D, cfg.rms_norm_eps, rngs, pd)
    self.attn_sink = p(rngs, (H,), ("heads",), sharding.constant(0.0), jnp.float32)
    self.wo_a = p(rngs, (G, cfg.heads_per_group * D, O), ("o_groups", "o_in", "o_lora"),
                  sharding.fan_in_normal((1,)), pd)
    self.wo_b = p(rngs, (G * O, d), ("o_cat", "embed"), sharding.fan_in_normal((0,)), pd)

  @property
  def inv_freq(self):
    return layer_inv_freq(self.cfg, self.spec)

  def q_latent(self, x_BxTxD: jax.Array) -> jax.Array:
    """c_q = RMSNorm_w(x @ wq_a) [B, T, q_lora] (docs/design.md §4.1); the indexer reads it too."""
    dt = jnp.dtype(self.cfg.dtype)
    c_q = jnp.einsum("btd,dq->btq", x_BxTxD.astype(dt), self.wq_a[...].astype(dt))
    return self.q_norm(c_q)

  def queries(self, c_q_BxTxQ: jax.Array, positions_BxT: jax.Array) -> jax.Array:
    """q [B, T, H, D] from the latent: per-head projection, optional head norm, RoPE."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    q = jnp.einsum("btq,qhd->bthd", c_q_BxTxQ.astype(dt), self.wq_b[...].astype(dt))
    if cfg.q_head_norm:
      q = rms_norm(q, None, cfg.rms_norm_eps)
    q = apply_rope(q, positions_BxT, self.inv_freq)
    return sharding.constrain(q, ("batch", "seq", "heads", None))

  def swa_kv(self, x_BxTxD: jax.Array, positions_BxT: jax.Array) -> jax.Array:
    """kv [B, T, D] (docs/design.md §4.2): RMSNorm_w(x @ wkv), RoPE, FP8 fake-quant when configured."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    kv = self.kv_norm(jnp.einsum("btd,dc->btc", x_BxTxD.astype(dt), self.wkv[...].astype(dt)))
    kv = apply_rope(kv, positions_BxT, self.inv_freq)
    if cfg.fp8_swa_kv:
      kv = dispatch.call("fake_quant_fp8_swa", kv, policy=cfg.ops.fake_quant_fp8_swa)
    return sharding.constrain(kv, ("batch", "seq", None))

  def output(self, o_BxTxHxD: jax.Array, positions_BxT: jax.Array) -> jax.Array:
    """y [B, T, d] (docs/design.md §4.4): de-rotate, then the grouped low-rank output projection."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    B, T, H, D = o_BxTxHxD.shape
    o = apply_rope(o_BxTxHxD, positions_BxT, self.inv_freq, inverse=True)
    o = o.reshape(B, T, cfg.o_groups, cfg.heads_per_group * D)
    u = jnp.einsum("btgi,gio->btgo", o, self.wo_a[...].astype(dt))
    u = sharding.constrain(u, ("batch", "seq", "o_groups", None))
    y = jnp.einsum("btc,cd->btd", u.reshape(B, T, cfg.o_groups * cfg.o_lora_rank),
                   self.wo_b[...].astype(dt))
    return sharding.constrain(y, ("batch", "seq", None))

  def __call__(self, x_BxTxD: jax.Array, *, positions_BxT: jax.Array, segment_ids_BxT: jax.Array,
               kv: CompressedKV | None = None, topk_BxTxK: jax.Array | None = None,
               c_q_BxTxQ: jax.Array | None = None, plan=None
               ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(y_BxTxD, c_q_BxTxQ, global_probs_BxTxK or None).

    `kv` and `topk_BxTxK` (−1 = empty slot) switch on the global branch (layers with ratio ≠ 0);
    slots naming entries invisible to their query are dropped (`visible_topk`). Pass `c_q_BxTxQ`
    when it was already computed with `q_latent` (the indexer needs it before attention runs).
    `global_probs_BxTxK` is the per-slot probability summed over heads, the indexer-loss target.
    `plan`: `selection_plan` of this `kv` and `topk_BxTxK`, or None.
    """
    cfg = self.cfg
    if (kv is None) != (topk_BxTxK is None):
      raise ValueError("kv and topk_BxTxK must be given together")
    x = x_BxTxD.astype(jnp.dtype(cfg.dtype))
    c_q = self.q_latent(x) if c_q_BxTxQ is None else c_q_BxTxQ
    q = self.queries(c_q, positions_BxT)
    swa = self.swa_kv(x, positions_BxT)
    global_kv = topk = None
    if kv is not None:
      global_kv = kv.main_kv_BxNxD.astype(q.dtype)
      topk = visible_topk(topk_BxTxK, kv, segment_ids_BxT)
    o, global_probs = dispatch.call(
        "sparse_attention", q, swa, segment_ids_BxT, self.attn_sink[...], global_kv, topk,
        policy=cfg.ops.sparse_attention, plan=plan, **op_static(cfg))
    o = sharding.constrain(o, ("batch", "seq", "heads", None))
    return self.output(o, positions_BxT), c_q, global_probs
