"""RMSNorm (docs/design.md §3.2 collapse -> `attn_norm` / `ffn_norm`, the q/kv/compressor/indexer norms).

y = x · rsqrt(mean(x², -1) + eps) · weight, computed in float32 and cast back to x's dtype.
V4.1 uses eps = rms_norm_eps = 1e-20 (docs/design.md §1). `weight=None` gives the unweighted form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
  """RMS-normalise the last axis of `x` (float32 math), times `weight` if given; x's dtype out."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * weight.astype(jnp.float32)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """Weighted RMSNorm over the last axis; parameter `scale` [dim] (logical axis "norm"), init 1."""

  def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = sharding.param(rngs, (dim,), ("norm",), sharding.constant(1.0), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)
