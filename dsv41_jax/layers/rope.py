"""Rotary position embedding with the YaRN frequency blend (docs/design.md §4.1, §4.5).

RoPE acts on the trailing `rope_dim` channels of a vector, as interleaved pairs of adjacent
channels (2i, 2i+1). Positions come from the packed row's `positions` (restarting at each
document, docs/design.md §14), never from the row index.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_inv_freq(rope_dim: int, theta: float, *, yarn: bool = False, factor: float = 1.0,
                  original_max_position: int = 0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> np.ndarray:
  """Inverse frequencies [rope_dim // 2] (float64), with the YaRN blend when `yarn`.

  Plain: ω_i = θ^(−2i/r). YaRN: dimensions rotating fewer than `beta_slow` times over the original
  context are interpolated (ω/factor), those rotating more than `beta_fast` times keep ω, and a
  linear ramp blends the band between; the attention scale (mscale) stays 1 (docs/design.md §1).
  """
  half = rope_dim // 2
  inv = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
  if not yarn:
    return inv

  def correction_dim(n_rot: float) -> float:
    # The dimension index whose wavelength fits `n_rot` turns into the original context.
    return rope_dim * math.log(original_max_position / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(correction_dim(beta_fast)), 0)
  high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  keep = 1.0 - ramp  # 1 → keep the original frequency (fast dims), 0 → interpolate
  return inv / factor * (1.0 - keep) + inv * keep


def layer_inv_freq(cfg, spec) -> np.ndarray:
  """The inverse frequencies one layer uses for all of its RoPE (q, SWA KV, compressed KV, indexer)."""
  return rope_inv_freq(cfg.qk_rope_head_dim, spec.rope_theta, yarn=spec.yarn,
                       factor=cfg.yarn_factor,
                       original_max_position=cfg.yarn_original_max_position,
                       beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow)


def apply_rope(x, positions, inv_freq, *, inverse: bool = False):
  """Rotate the trailing `2·len(inv_freq)` channels of `x` [..., T, (H,) C] by `positions` [..., T].

  `positions` broadcasts against x's leading dims; when x has a head axis after T, pass positions
  of shape [B, T] and x of shape [B, T, H, C]. `inverse=True` applies the rotation by −position
  (used to de-rotate the attention output, docs/design.md §4.4). Math in float32, result in x's dtype.

  Written over the whole width as x·cos + swap(x)·sin, swap exchanging the channels of each pair
  and sin carrying the pair's sign (−sin on its first channel), with the channels before the
  rotated ones passed through by a select: one elementwise pass over x, forward and backward,
  where slicing off the rotated part and concatenating it back took two (a concatenation as the
  fusion's root: 3.3 ms of s3's micro-batch on the H100, benchmarks/gpu_runs/2026-12-06/s57_prof).
  The same values bit for bit: a·cos + b·(−sin) is a·cos − b·sin and b·cos + a·sin is a·sin + b·cos
  in IEEE arithmetic, op by op (tests/dsv41_jax/layers/test_rope.py); compiled, XLA may contract
  a product and a sum into one FMA in either form, so float32 results can differ by an ulp before
  the cast.
  """
  r = 2 * len(inv_freq)
  c = x.shape[-1]
  pos = positions.astype(jnp.float32)
  while pos.ndim < x.ndim - 1:
    pos = pos[..., None]
  angle = pos[..., None] * jnp.asarray(inv_freq, jnp.float32)          # [..., r/2]
  if inverse:
    angle = -angle
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  if c % 2:   # the pairs (2i, 2i + 1) of the rotated channels are not the pairs of the width
    rot = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
    a, b = rot[..., 0], rot[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], r)
    return jnp.concatenate([x[..., :-r], out.astype(x.dtype)], axis=-1)
  # Full-width tables [..., C] (small: no head axis): 1 and 0 before the rotated channels.
  lead = angle.shape[:-1]
  cos_c = jnp.concatenate([jnp.ones(lead + (c - r,), jnp.float32),
                           jnp.repeat(cos, 2, axis=-1)], axis=-1)
  sin_c = jnp.concatenate([jnp.zeros(lead + (c - r,), jnp.float32),
                           jnp.stack([-sin, sin], axis=-1).reshape(*lead, r)], axis=-1)
  xf = x.astype(jnp.float32)
  swapped = xf.reshape(*x.shape[:-1], c // 2, 2)[..., ::-1].reshape(x.shape)
  rotated = np.arange(c) >= c - r                                       # [C] constant
  return jnp.where(rotated, xf * cos_c + swapped * sin_c, xf).astype(x.dtype)
