"""Muon for the matrix group, vanilla and head-wise (TRAINING.md §2).

Per parameter: `m ← β m + g` (one buffer), Nesterov direction `d = g + β m`, orthogonalized by
Newton–Schulz in float32 (8 steps of (3.4445, −4.7750, 2.0315), then 2 of (2, −1.5, 0.5), which
bring every singular value to 1 within ~5e-4), then rescaled so the update RMS is `update_rms`
(0.18): an m×n matrix with unit singular values has RMS 1/√max(m, n).

Axes are counted from the END, so leading scan-stacked layer axes and expert / group axes are batch
axes: a vanilla weight orthogonalizes its last two axes `(in, out)`; a head-wise weight
`(..., in, heads, head_dim)` orthogonalizes each `(in, head_dim)` head on its own.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import table as table_lib

NS_COEFFS: tuple[tuple[float, float, float], ...] = (
    ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2)

_HI = jax.lax.Precision.HIGHEST


def newton_schulz(x_BxMxN: jax.Array, coeffs=NS_COEFFS) -> jax.Array:
  """Approximate U Vᵀ of each matrix in the batch (float32 throughout).

  The matrix is normalized by its Frobenius norm (so every singular value is ≤ 1), then each step
  maps X ← aX + (bA + cA²)X with A = XXᵀ, i.e. each singular value s ← as + bs³ + cs⁵.
  """
  x = x_BxMxN.astype(jnp.float32)
  tall = x.shape[-2] > x.shape[-1]
  if tall:  # iterate on the wide orientation: A is min(m, n)²
    x = jnp.swapaxes(x, -1, -2)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  x = x / jnp.maximum(norm, 1e-30)
  for a, b, c in coeffs:
    a_MxM = jnp.einsum("...mn,...kn->...mk", x, x, precision=_HI)
    b_MxM = b * a_MxM + c * jnp.einsum("...mk,...kl->...ml", a_MxM, a_MxM, precision=_HI)
    x = a * x + jnp.einsum("...mk,...kn->...mn", b_MxM, x, precision=_HI)
  if tall:
    x = jnp.swapaxes(x, -1, -2)
  return x


def orthogonalize(g: jax.Array, headwise: bool) -> jax.Array:
  """Newton–Schulz over the last two axes, or over (in, head_dim) per head for `headwise`."""
  if not headwise:
    return newton_schulz(g)
  g_hxIxD = jnp.moveaxis(g, -2, -3)          # (..., in, heads, hd) -> (..., heads, in, hd)
  return jnp.moveaxis(newton_schulz(g_hxIxD), -3, -2)


def matrix_dims(shape: tuple[int, ...], headwise: bool) -> tuple[int, int]:
  """(rows, cols) of each matrix that is orthogonalized on its own."""
  return (shape[-3], shape[-1]) if headwise else (shape[-2], shape[-1])


def muon_direction(d: jax.Array, headwise: bool, update_rms: float) -> jax.Array:
  """Orthogonalized direction scaled to RMS `update_rms` (√max(m, n) · update_rms · UVᵀ)."""
  m, n = matrix_dims(d.shape, headwise)
  return (orthogonalize(d, headwise) * (update_rms * max(m, n) ** 0.5)).astype(d.dtype)


class MuonState(NamedTuple):
  momentum: optax.Updates


def scale_by_muon(momentum: float, update_rms: float,
                  headwise: Callable[[str], bool]) -> optax.GradientTransformation:
  """Nesterov momentum + Newton–Schulz + RMS rescaling; `headwise(path)` picks the variant."""

  def init_fn(params):
    return MuonState(momentum=table_lib.map_params(lambda _, p: jnp.zeros_like(p), params))

  def update_fn(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda m, g: momentum * m + g, state.momentum, updates)

    def leaf(path, g, m):
      return muon_direction(g + momentum * m, headwise(path), update_rms)

    flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
    flat_m = treedef.flatten_up_to(new_m)
    out = [leaf(table_lib.path_str(p), g, m) for (p, g), m in zip(flat_g, flat_m)]
    return jax.tree.unflatten(treedef, out), MuonState(momentum=new_m)

  return optax.GradientTransformation(init_fn, update_fn)
