"""Sinkhorn-balanced momentum for embedding, output head and Engram tables (TRAINING.md §2).

Per parameter: one buffer `m ← β m + g`, Nesterov direction `d = g + β m`, then K alternations of
"divide each row by its RMS, then each column by its RMS" over the last two axes (leading axes are
batch axes), then a rescale of each matrix to RMS `update_rms` (0.18).

τ is a relative floor: a row (column) RMS below τ × the mean row (column) RMS is treated as that
floor, so rows that got (almost) no gradient are not blown up to unit size; ε guards the division.
A row of zeros stays exactly zero.

Where the floor acts. Applied only inside the iterations, the floor protects a starved row for one
iteration: a row at relative size ρ < τ leaves iteration k at min(1, ρ/τᵏ), i.e. at unit size after
two or three of the eleven iterations, which defeats its purpose. So the floor is applied to the
*input*: rows, then columns, whose RMS lies below τ × the mean are lifted to the floor, the lifted
matrix is balanced (with the same floor rule in every iteration), and the resulting row and column
scalings are applied to the actual direction (the lift is divided out). A starved row thus ends at
about ρ/τ of a typical row, never at unit size; ordinary rows are untouched by the lift.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import table as table_lib


def _divide_by_rms(x: jax.Array, axis: int, tau: float, eps: float) -> jax.Array:
  rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=axis, keepdims=True))
  floor = tau * jnp.mean(rms, axis=-1 if axis == -2 else -2, keepdims=True)
  return x / jnp.maximum(jnp.maximum(rms, floor), eps)


def _lift(x: jax.Array, axis: int, tau: float) -> jax.Array:
  """Factor (≥ 1) raising each row / column RMS below τ × the mean RMS to that floor; 1 for zeros."""
  rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=axis, keepdims=True))
  floor = tau * jnp.mean(rms, axis=-1 if axis == -2 else -2, keepdims=True)
  return jnp.where(rms > 0, jnp.maximum(rms, floor) / jnp.where(rms > 0, rms, 1.0), 1.0)


def sinkhorn_balance(d_RxC: jax.Array, iters: int, tau: float, eps: float) -> jax.Array:
  """K alternations of row then column RMS normalization (float32), batched over leading axes,
  with starved rows / columns kept at their floored relative size (module docstring)."""
  x = d_RxC.astype(jnp.float32)
  lift_Rx1 = _lift(x, -1, tau)
  x = x * lift_Rx1
  lift_1xC = _lift(x, -2, tau)
  x = x * lift_1xC
  for _ in range(iters):
    x = _divide_by_rms(x, -1, tau, eps)   # each row by its RMS
    x = _divide_by_rms(x, -2, tau, eps)   # each column by its RMS
  return x / (lift_Rx1 * lift_1xC)


def rescale_rms(x: jax.Array, target: float, eps: float) -> jax.Array:
  """Scale each matrix (last two axes) to RMS `target`; an all-zero matrix stays zero."""
  rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=(-2, -1), keepdims=True))
  return x * (target / jnp.maximum(rms, eps))


def sinkhorn_direction(d: jax.Array, iters: int, tau: float, eps: float,
                       update_rms: float) -> jax.Array:
  return rescale_rms(sinkhorn_balance(d, iters, tau, eps), update_rms, eps).astype(d.dtype)


class SinkhornState(NamedTuple):
  momentum: optax.Updates


def scale_by_sinkhorn(momentum: float, iters: int, tau: float, eps: float,
                      update_rms: float) -> optax.GradientTransformation:
  """Nesterov momentum + Sinkhorn balancing + RMS rescaling."""

  def init_fn(params):
    return SinkhornState(momentum=table_lib.map_params(lambda _, p: jnp.zeros_like(p), params))

  def update_fn(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda m, g: momentum * m + g, state.momentum, updates)
    out = jax.tree.map(
        lambda g, m: sinkhorn_direction(g + momentum * m, iters, tau, eps, update_rms),
        updates, new_m)
    return out, SinkhornState(momentum=new_m)

  return optax.GradientTransformation(init_fn, update_fn)
