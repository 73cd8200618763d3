"""CSA2 compressor: pools every m tokens into one compressed KV entry (docs/design.md §5.2, §14).

Shapes, for a row of T tokens and ratio m (N = ⌈T/m⌉ entries; the row is zero-padded to N·m):

  x_BxTxD ──wkv──▶ C_BxTxC ┐
          ──wgate─▶ Z_BxTxC ┴─ per-channel softmax over each group's m tokens ─▶ c_BxNxC
  latent_BxNxC = RMSNorm_w(c)                         (pre-RoPE; feeds the indexer K, §5.3)
  main_kv_BxNxC = latent, trailing rope dims rotated at the group's first `position`,
                  then FP4 fake-quant (block 16, E4M3 scale) when `cfg.fp4_main_kv` (§9.3)

At m = 1 there is no gate: c = x·wkv. Entry g covers rows [g·m, (g+1)·m); its metadata
(`entry_segment`, `entry_last`, `entry_pos`) is what `types.entry_visible` reads for causal and
document visibility.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.layers import norm, rope
from pallas_kernels import dispatch


def _group(a_BxTxC: jax.Array, m: int) -> jax.Array:
  """[B, T, C] → [B, N, m, C], zero-padding the row to N·m tokens."""
  b, t = a_BxTxC.shape[:2]
  n = -(-t // m)
  pad = n * m - t
  if pad:
    a_BxTxC = jnp.pad(a_BxTxC, [(0, 0), (0, pad)] + [(0, 0)] * (a_BxTxC.ndim - 2))
  return a_BxTxC.reshape(b, n, m, *a_BxTxC.shape[2:])


def compress(x_BxTxD: jax.Array, wkv_DxC: jax.Array, wgate_DxC: jax.Array | None,
             m: int) -> jax.Array:
  """Pooled entries c_BxNxC: c_g = Σ_{j∈g} softmax_{j∈g}(x_j·wgate) ⊙ (x_j·wkv), per channel.

  m = 1 takes no gate and returns x·wkv in x's dtype; m > 1 computes in float32. Padding rows of
  an incomplete last group take part in the softmax as zero vectors; such an entry is never
  visible (its `entry_segment` is −1), so the value does not matter.
  """
  if m == 1:
    if wgate_DxC is not None:
      raise ValueError("compress: m = 1 has no gate (docs/design.md §5.2); pass wgate_DxC=None")
    return jnp.einsum("btd,dc->btc", x_BxTxD, wkv_DxC.astype(x_BxTxD.dtype))
  if wgate_DxC is None:
    raise ValueError(f"compress: m = {m} > 1 needs the gate weight wgate")
  x = _group(x_BxTxD.astype(jnp.float32), m)                              # [B, N, m, D]
  c_BxNxmxC = jnp.einsum("bnjd,dc->bnjc", x, wkv_DxC.astype(jnp.float32))
  z_BxNxmxC = jnp.einsum("bnjd,dc->bnjc", x, wgate_DxC.astype(jnp.float32))
  return jnp.sum(jax.nn.softmax(z_BxNxmxC, axis=2) * c_BxNxmxC, axis=2)


def entry_metadata(positions_BxT: jax.Array, segment_ids_BxT: jax.Array,
                   m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(entry_segment_BxN, entry_last_BxN, entry_pos_BxN), int32 (docs/design.md §5.2, §14).

  entry_segment: the group's document when all m tokens share one document (> 0), else −1
  (straddles a boundary, holds padding, or is cut off by the row's end); entry_last = (g+1)·m − 1;
  entry_pos = `position` of the group's first token.
  """
  b, t = segment_ids_BxT.shape
  n = -(-t // m)
  seg_BxNxm = _group(segment_ids_BxT.astype(jnp.int32), m)    # padding rows get segment 0
  first = seg_BxNxm[:, :, 0]
  whole = jnp.all(seg_BxNxm == first[..., None], axis=-1) & (first > 0)
  entry_segment = jnp.where(whole, first, -1).astype(jnp.int32)
  entry_last = jnp.broadcast_to((jnp.arange(n, dtype=jnp.int32) + 1) * m - 1, (b, n))
  entry_pos = positions_BxT[:, ::m].astype(jnp.int32)
  return entry_segment, entry_last, entry_pos


class Compressor(nnx.Module):
  """The weights of one Full layer's compressor: `wkv`, `wgate` (m > 1 only), `norm/scale`."""

  def __init__(self, cfg, spec, rngs: nnx.Rngs):
    if not spec.owns_compressor:
      raise ValueError(f"layer {spec.index} is a {spec.mode} layer; only Full layers own a compressor")
    self.m = int(spec.compress_ratio)
    self.rope_dim = cfg.qk_rope_head_dim
    self.fp4 = bool(cfg.fp4_main_kv)
    self.policies = cfg.ops
    pdt = jnp.dtype(cfg.param_dtype)
    init = sharding.fan_in_normal((0,))
    self.wkv = sharding.param(rngs, (cfg.hidden_size, cfg.head_dim), ("embed", "kv"), init, pdt)
    self.wgate = (sharding.param(rngs, (cfg.hidden_size, cfg.head_dim), ("embed", "kv"), init, pdt)
                  if self.m > 1 else None)
    self.norm = norm.RMSNorm(cfg.head_dim, cfg.rms_norm_eps, rngs, param_dtype=pdt)

  def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, segment_ids_BxT: jax.Array,
               inv_freq) -> tuple[jax.Array, ...]:
    """(main_kv_BxNxC, latent_BxNxC, entry_segment_BxN, entry_last_BxN, entry_pos_BxN).

    `latent` is pre-RoPE (the indexer K input); both come back in x's dtype.
    """
    wgate = None if self.wgate is None else self.wgate[...]
    c_BxNxC = compress(x_BxTxD, self.wkv[...], wgate, self.m)
    latent_BxNxC = self.norm(c_BxNxC)
    entry_segment, entry_last, entry_pos = entry_metadata(positions_BxT, segment_ids_BxT, self.m)
    main_kv_BxNxC = rope.apply_rope(latent_BxNxC, entry_pos, inv_freq)
    if self.fp4:
      main_kv_BxNxC = dispatch.call("fake_quant_fp4_main_kv", main_kv_BxNxC,
                                    policy=self.policies.fake_quant_fp4_main_kv)
    dt = x_BxTxD.dtype
    return (main_kv_BxNxC.astype(dt), latent_BxNxC.astype(dt), entry_segment, entry_last,
            entry_pos)
