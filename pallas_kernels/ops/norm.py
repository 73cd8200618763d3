"""Op: RMSNorm of the last axis (docs/design.md §3.2 collapse -> `attn_norm` / `ffn_norm`, §4.1).

y = x · rsqrt(mean(x², -1) + eps) · weight, computed in float32 and cast back to x's dtype.
V4.1 uses eps = rms_norm_eps = 1e-20 (docs/design.md §1). `weight=None` gives the unweighted form.
The model's `RMSNorm` module (`dsv41_jax/layers/norm.py`) holds the weight and calls this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
  """RMS-normalise the last axis of `x` (float32 math), times `weight` if given; x's dtype out."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * weight.astype(jnp.float32)
  return y.astype(x.dtype)
