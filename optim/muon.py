"""Muon for the matrix group, vanilla and head-wise (docs/design.md §T2).

Per parameter: `m ← β m + g` (one buffer), Nesterov direction `d = g + β m`, orthogonalized by
Newton–Schulz (8 steps of (3.4445, −4.7750, 2.0315), then 2 of (2, −1.5, 0.5), which bring every
singular value to 1 within ~5e-4), then rescaled so the update RMS is `update_rms` (0.18): an m×n
matrix with unit singular values has RMS 1/√max(m, n).

Axes are counted from the END, so leading scan-stacked layer axes and expert / group axes are batch
axes: a vanilla weight orthogonalizes its last two axes `(in, out)`; a head-wise weight
`(..., in, heads, head_dim)` orthogonalizes each `(in, head_dim)` head on its own.

Batched: every matrix of every Muon parameter is one item of a batch. Items of the same (rows,
cols), after turning tall matrices wide, are concatenated and go through ONE Newton–Schulz call
whose iterations are a `lax.fori_loop` over the coefficient table, so the compiled update holds one
Newton–Schulz body per distinct matrix shape, however many parameters share it.

Precision (`ns_dtype`): "float32" runs the products in float32 at HIGHEST precision; "bfloat16"
feeds them bfloat16 operands with float32 accumulation (the iterate itself stays float32), the
tensor-core path of accelerators; "auto" picks float32 on CPU and bfloat16 elsewhere.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import table as table_lib

NS_COEFFS: tuple[tuple[float, float, float], ...] = (
    ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2)
NS_DTYPES = ("auto", "float32", "bfloat16")

_HI = jax.lax.Precision.HIGHEST


def resolve_ns_dtype(ns_dtype: str) -> str:
  """"auto" → "float32" on CPU, "bfloat16" on GPU / TPU (the default backend at trace time)."""
  if ns_dtype not in NS_DTYPES:
    raise ValueError(f"muon_ns_dtype must be one of {NS_DTYPES} (got {ns_dtype!r})")
  if ns_dtype == "auto":
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
  return ns_dtype


def newton_schulz(x_BxMxN: jax.Array, coeffs=NS_COEFFS, ns_dtype: str = "float32") -> jax.Array:
  """Approximate U Vᵀ of each matrix in the batch (float32 iterate, see `ns_dtype` above).

  The matrix is normalized by its Frobenius norm (so every singular value is ≤ 1), then each step
  maps X ← aX + (bA + cA²)X with A = XXᵀ, i.e. each singular value s ← as + bs³ + cs⁵.
  """
  ns_dtype = resolve_ns_dtype(ns_dtype)
  x = x_BxMxN.astype(jnp.float32)
  tall = x.shape[-2] > x.shape[-1]
  if tall:  # iterate on the wide orientation: A is min(m, n)²
    x = jnp.swapaxes(x, -1, -2)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  x = x / jnp.maximum(norm, 1e-30)
  if ns_dtype == "float32":
    mm = lambda eq, u, v: jnp.einsum(eq, u, v, precision=_HI)
  else:
    mm = lambda eq, u, v: jnp.einsum(eq, u.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                     preferred_element_type=jnp.float32)
  table = jnp.asarray(np.asarray(coeffs, np.float32))

  def step(i, x):
    a, b, c = table[i, 0], table[i, 1], table[i, 2]
    a_MxM = mm("...mn,...kn->...mk", x, x)
    b_MxM = b * a_MxM + c * mm("...mk,...kl->...ml", a_MxM, a_MxM)
    return a * x + mm("...mk,...kn->...mn", b_MxM, x)

  x = jax.lax.fori_loop(0, len(coeffs), step, x)
  if tall:
    x = jnp.swapaxes(x, -1, -2)
  return x


def _as_matrices(g: jax.Array, headwise: bool) -> jax.Array:
  """[items, rows, cols] view of a parameter's matrices (heads moved next to the batch axes)."""
  x = jnp.moveaxis(g, -2, -3) if headwise else g       # (..., in, heads, hd) -> (..., heads, in, hd)
  return x.reshape(-1, *x.shape[-2:])


def _from_matrices(x: jax.Array, like: jax.Array, headwise: bool) -> jax.Array:
  if headwise:
    *lead, i, h, d = like.shape
    return jnp.moveaxis(x.reshape(*lead, h, i, d), -3, -2)
  return x.reshape(like.shape)


def orthogonalize_many(gs: Sequence[jax.Array], headwise: Sequence[bool],
                       ns_dtype: str = "float32") -> list[jax.Array]:
  """`orthogonalize` of every array, with one batched Newton–Schulz per distinct matrix shape."""
  mats = [_as_matrices(g, h) for g, h in zip(gs, headwise)]
  by_shape: dict[tuple[int, int], list[int]] = {}
  for i, x in enumerate(mats):
    by_shape.setdefault(tuple(sorted(x.shape[-2:])), []).append(i)
  out: list[jax.Array | None] = [None] * len(mats)
  for (small, _), idx in by_shape.items():
    # Tall matrices turned wide, so every item of the batch iterates on the same orientation.
    wide = [mats[i] if mats[i].shape[-2] == small else jnp.swapaxes(mats[i], -1, -2) for i in idx]
    sizes = np.cumsum([w.shape[0] for w in wide])[:-1]
    done = jnp.split(newton_schulz(jnp.concatenate(wide, axis=0), ns_dtype=ns_dtype), sizes)
    for i, y in zip(idx, done):
      y = y if mats[i].shape[-2] == small else jnp.swapaxes(y, -1, -2)
      out[i] = _from_matrices(y, gs[i], headwise[i])
  return out


def orthogonalize(g: jax.Array, headwise: bool, ns_dtype: str = "float32") -> jax.Array:
  """Newton–Schulz over the last two axes, or over (in, head_dim) per head for `headwise`."""
  return orthogonalize_many([g], [headwise], ns_dtype)[0]


def matrix_dims(shape: tuple[int, ...], headwise: bool) -> tuple[int, int]:
  """(rows, cols) of each matrix that is orthogonalized on its own."""
  return (shape[-3], shape[-1]) if headwise else (shape[-2], shape[-1])


def rms_scale(shape: tuple[int, ...], headwise: bool, update_rms: float) -> float:
  """√max(m, n) · update_rms: the factor that gives an orthogonal m×n matrix RMS `update_rms`."""
  m, n = matrix_dims(shape, headwise)
  return update_rms * max(m, n) ** 0.5


def muon_direction(d: jax.Array, headwise: bool, update_rms: float,
                   ns_dtype: str = "float32") -> jax.Array:
  """Orthogonalized direction scaled to RMS `update_rms` (√max(m, n) · update_rms · UVᵀ)."""
  scale = rms_scale(d.shape, headwise, update_rms)
  return (orthogonalize(d, headwise, ns_dtype) * scale).astype(d.dtype)


class MuonState(NamedTuple):
  momentum: optax.Updates


def scale_by_muon(momentum: float, update_rms: float, headwise: Callable[[str], bool],
                  ns_dtype: str = "auto") -> optax.GradientTransformation:
  """Nesterov momentum + Newton–Schulz + RMS rescaling; `headwise(path)` picks the variant.

  All parameters' matrices are orthogonalized together (`orthogonalize_many`)."""

  def init_fn(params):
    return MuonState(momentum=table_lib.map_params(lambda _, p: jnp.zeros_like(p), params))

  def update_fn(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda m, g: momentum * m + g, state.momentum, updates)

    flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
    flat_m = treedef.flatten_up_to(new_m)
    hw = [headwise(table_lib.path_str(p)) for p, _ in flat_g]
    dirs = [g + momentum * m for (_, g), m in zip(flat_g, flat_m)]
    orth = orthogonalize_many(dirs, hw, ns_dtype)
    out = [(o * rms_scale(d.shape, h, update_rms)).astype(d.dtype)
           for o, d, h in zip(orth, dirs, hw)]
    return jax.tree.unflatten(treedef, out), MuonState(momentum=new_m)

  return optax.GradientTransformation(init_fn, update_fn)
