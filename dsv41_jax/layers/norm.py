"""RMSNorm weights (docs/design.md §3.2 collapse -> `attn_norm` / `ffn_norm`, the q/kv/compressor/indexer norms).

The math is the op `pallas_kernels.ops.norm.rms_norm` (float32, x's dtype out); the module holds
the weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from pallas_kernels.ops.norm import rms_norm


class RMSNorm(nnx.Module):
  """Weighted RMSNorm over the last axis; parameter `scale` [dim] (logical axis "norm"), init 1."""

  def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = sharding.param(rngs, (dim,), ("norm",), sharding.constant(1.0), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)
