"""Independent float64 numpy references of each optimizer update (docs/design.md §T2)."""

from __future__ import annotations

import numpy as np


def polar(g: np.ndarray) -> np.ndarray:
  """U Vᵀ of each matrix over the last two axes (exact, by SVD)."""
  u, _, vt = np.linalg.svd(np.asarray(g, np.float64), full_matrices=False)
  return u @ vt


def muon_direction(d: np.ndarray, headwise: bool, rms: float) -> np.ndarray:
  d = np.asarray(d, np.float64)
  if headwise:
    o = np.moveaxis(polar(np.moveaxis(d, -2, -3)), -3, -2)
    m, n = d.shape[-3], d.shape[-1]
  else:
    o = polar(d)
    m, n = d.shape[-2], d.shape[-1]
  return o * rms * np.sqrt(max(m, n))


def sinkhorn(d: np.ndarray, iters: int, tau: float, eps: float) -> np.ndarray:
  """Row-then-column RMS normalization with the relative floor, one matrix at a time (starved rows
  and columns lifted to the floor first; the lift is divided out at the end)."""
  d = np.asarray(d, np.float64)
  out = np.empty_like(d)
  for idx in np.ndindex(*d.shape[:-2]):
    x = d[idx].copy()
    lifts = []
    for axis in (1, 0):   # lift starved rows, then columns, to the floor
      norm = np.sqrt(np.mean(x * x, axis=axis))
      lift = np.ones_like(norm)
      nz = norm > 0
      lift[nz] = np.maximum(norm[nz], tau * norm.mean()) / norm[nz]
      lift = lift[:, None] if axis == 1 else lift[None, :]
      x = x * lift
      lifts.append(lift)
    for _ in range(iters):
      r = np.sqrt(np.mean(x * x, axis=1))
      r = np.maximum(np.maximum(r, tau * r.mean()), eps)
      x = x / r[:, None]
      c = np.sqrt(np.mean(x * x, axis=0))
      c = np.maximum(np.maximum(c, tau * c.mean()), eps)
      x = x / c[None, :]
    out[idx] = x / (lifts[0] * lifts[1])
  return out


def rescale(x: np.ndarray, rms: float) -> np.ndarray:
  cur = np.sqrt(np.mean(x * x, axis=(-2, -1), keepdims=True))
  return x * rms / cur


def sinkhorn_sub_tables(d: np.ndarray, blocks, iters: int, tau: float, eps: float,
                        rms: float) -> np.ndarray:
  """Each (offset, rows) block of rows balanced and rescaled as a matrix of its own, by slicing;
  rows in no block are zero."""
  d = np.asarray(d, np.float64)
  out = np.zeros_like(d)
  for o, n in blocks:
    out[..., o:o + n, :] = rescale(sinkhorn(d[..., o:o + n, :], iters, tau, eps), rms)
  return out


def adam(g_steps, b1, b2, eps):
  """Bias-corrected Adam directions for a sequence of gradients."""
  m = np.zeros_like(g_steps[0], np.float64)
  v = np.zeros_like(g_steps[0], np.float64)
  outs = []
  for t, g in enumerate(g_steps, start=1):
    g = np.asarray(g, np.float64)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
    outs.append(mh / (np.sqrt(vh) + eps))
  return outs


def rms(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.sqrt(np.mean(x * x)))


def lowered_loop_bodies(trip_count: int) -> int:
  """How many copies of a loop body the lowered text of `optim.muon`'s Newton–Schulz loops holds
  for `trip_count` steps: jax 0.11 writes `fori_loop(..., unroll=muon._UNROLL)` as that many
  bodies in the while loop plus the remainder's, jax 0.10 keeps one body (counted on a one-product
  loop, so tests can count products per Newton–Schulz step)."""
  import jax
  import jax.numpy as jnp
  from optim import muon
  x = jax.ShapeDtypeStruct((2, 2), jnp.float32)
  loop = lambda x: jax.lax.fori_loop(0, trip_count, lambda i, y: y @ y, x, unroll=muon._UNROLL)
  return jax.jit(loop).lower(x).as_text().count("dot_general")
