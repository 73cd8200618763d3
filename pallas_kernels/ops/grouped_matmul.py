"""Op: the grouped matmul of the routed experts (docs/design.md §8.2; §T7).

With group g owning rows [s_g, s_g + n_g) of x, s_g = Σ_{g'<g} n_g':

  y[r] = x[r] · w[g(r)]          [M, K] × [G, K, N] -> [M, N] float32; rows past Σ n_g are 0

accumulated in float32 and returned in `out_dtype`: float32, or x's dtype (rounded once).

The reference is XLA's `jax.lax.ragged_dot` (exact, jax's own VJP; slow on the GPU, ~10 TFLOP/s,
benchmarks/RESULTS.md). It is the dispatcher's op `grouped_matmul`, whose kernel is the Mosaic GPU
grouped GEMM with its own backward (`pallas_kernels/grouped_matmul.py`). Group sizes that are
negative or sum past M raise ValueError when concrete and make the product NaN when traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _concrete(x):
  """x as a numpy array, or None while it is traced."""
  try:
    return np.asarray(x)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def grouped_matmul(x_sorted_PxD, w_ExDxF, group_sizes_E, out_dtype=jnp.float32):
  """Rows [Σ_{e'<e} g_e', Σ_{e'≤e} g_e') of x times w[e] (w cast to x's dtype); `out_dtype` out
  (float32 or x's dtype: the float32 product rounded once)."""
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(x_sorted_PxD.dtype)):
    raise ValueError(f"grouped_matmul out_dtype must be float32 or x's dtype "
                     f"{x_sorted_PxD.dtype}, got {out_dtype}")
  w = w_ExDxF.astype(x_sorted_PxD.dtype)
  sizes = group_sizes_E.astype(jnp.int32)
  n_rows = x_sorted_PxD.shape[0]
  known = _concrete(sizes)
  if known is not None and ((known < 0).any() or known.astype(np.int64).sum() > n_rows):
    raise ValueError(f"group sizes must be >= 0 and sum to at most the {n_rows} rows (min "
                     f"{known.min()}, sum {known.astype(np.int64).sum()})")
  bad = jnp.any(sizes < 0) | jnp.any(sizes > n_rows) | (jnp.sum(jnp.clip(sizes, 0, n_rows)) > n_rows)
  y = jax.lax.ragged_dot(x_sorted_PxD, w, sizes, preferred_element_type=jnp.float32)
  # + NaN or + 0 (y + 0 = y), not where(bad, NaN, y): inside a layer scan JAX hoists that where's
  # [M, N] NaN broadcast out of the loop as a buffer every layer then reads.
  return (y + jnp.where(bad, jnp.nan, 0.0)).astype(out_dtype)
