"""Sinkhorn-balanced momentum for embedding, output head and Engram tables (docs/design.md §T2).

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

Sub-tables. A parameter may hold several tables stacked along its rows (an Engram layer's 24 prime-
sized (order, head) tables, padded at the end, docs/design.md §7.2). Given their `blocks`, ((offset,
rows), ...) along axis −2, every statistic over rows (column RMS, the mean row RMS of the floor,
the final RMS) is taken within each block, so each table is balanced and rescaled on its own, as
if it were a separate matrix; rows in no block (the padding) come out zero. The block statistics
are segment sums over a row → block index, so a row-sharded table is never re-laid out.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import table as table_lib


Blocks = tuple[tuple[int, int], ...]    # (offset, rows) of each sub-table along axis -2


class _RowStats:
  """Means over rows (axis −2): of the whole matrix, or of each block of rows (module docstring)."""

  def __init__(self, n_rows: int, blocks: Blocks | None):
    self.blocks = blocks
    if blocks is None:
      return
    starts = jnp.asarray([o for o, _ in blocks], jnp.int32)
    sizes = jnp.asarray([n for _, n in blocks], jnp.int32)
    r = jnp.arange(n_rows, dtype=jnp.int32)
    b = jnp.maximum(jnp.searchsorted(starts, r, side="right") - 1, 0)   # last block starting ≤ r
    self.inside_R = (r >= starts[b]) & (r < starts[b] + sizes[b])
    self.block_R = jnp.where(self.inside_R, b, len(blocks))           # rows in no block: one extra
    self.sizes = jnp.concatenate([sizes, jnp.ones([1], jnp.int32)]).astype(jnp.float32)

  def mask(self, x: jax.Array) -> jax.Array:
    """Zero the rows in no block."""
    return x if self.blocks is None else jnp.where(self.inside_R[:, None], x, 0)

  def mean(self, v: jax.Array) -> jax.Array:
    """Mean of `v` [..., R, c] over the rows of each block, broadcastable back to `v`."""
    if self.blocks is None:
      return jnp.mean(v, axis=-2, keepdims=True)
    v_Rx = jnp.moveaxis(v, -2, 0)
    sums = jax.ops.segment_sum(v_Rx, self.block_R, num_segments=len(self.blocks) + 1)
    means = sums / self.sizes.reshape((-1,) + (1,) * (v_Rx.ndim - 1))
    return jnp.moveaxis(means[self.block_R], 0, -2)


def _rms_and_floor(x: jax.Array, axis: int, tau: float, rows: _RowStats):
  """RMS of each row (axis −1) or column (axis −2), and τ × the mean of those RMS values."""
  if axis == -1:
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True))
    return rms, tau * rows.mean(rms)
  rms = jnp.sqrt(rows.mean(jnp.square(x)))
  return rms, tau * jnp.mean(rms, axis=-1, keepdims=True)


def _divide_by_rms(x: jax.Array, axis: int, tau: float, eps: float, rows: _RowStats) -> jax.Array:
  rms, floor = _rms_and_floor(x, axis, tau, rows)
  return x / jnp.maximum(jnp.maximum(rms, floor), eps)


def _lift(x: jax.Array, axis: int, tau: float, rows: _RowStats) -> jax.Array:
  """Factor (≥ 1) raising each row / column RMS below τ × the mean RMS to that floor; 1 for zeros."""
  rms, floor = _rms_and_floor(x, axis, tau, rows)
  return jnp.where(rms > 0, jnp.maximum(rms, floor) / jnp.where(rms > 0, rms, 1.0), 1.0)


def sinkhorn_balance(d_RxC: jax.Array, iters: int, tau: float, eps: float,
                     blocks: Blocks | None = None) -> jax.Array:
  """K alternations of row then column RMS normalization (float32), batched over leading axes,
  with starved rows / columns kept at their floored relative size; each block of rows on its own
  when `blocks` is given (module docstring)."""
  rows = _RowStats(d_RxC.shape[-2], blocks)
  x = rows.mask(d_RxC.astype(jnp.float32))
  lift_Rx1 = _lift(x, -1, tau, rows)
  x = x * lift_Rx1
  lift_RxC = _lift(x, -2, tau, rows)
  x = x * lift_RxC

  def alternation(_, x):
    x = _divide_by_rms(x, -1, tau, eps, rows)   # each row by its RMS
    return _divide_by_rms(x, -2, tau, eps, rows)   # each column (of each block) by its RMS

  # A loop, not unrolled: the compiled update keeps one alternation body per parameter.
  x = jax.lax.fori_loop(0, iters, alternation, x)
  return x / (lift_Rx1 * lift_RxC)


def rescale_rms(x: jax.Array, target: float, eps: float, blocks: Blocks | None = None) -> jax.Array:
  """Scale each matrix (last two axes; each block of rows, if given) to RMS `target`; an all-zero
  matrix stays zero."""
  rows = _RowStats(x.shape[-2], blocks)
  rms = jnp.sqrt(jnp.mean(rows.mean(jnp.mean(jnp.square(x), axis=-1, keepdims=True)),
                          axis=-1, keepdims=True))
  return x * (target / jnp.maximum(rms, eps))


def sinkhorn_direction(d: jax.Array, iters: int, tau: float, eps: float, update_rms: float,
                       blocks: Blocks | None = None) -> jax.Array:
  balanced = sinkhorn_balance(d, iters, tau, eps, blocks)
  return rescale_rms(balanced, update_rms, eps, blocks).astype(d.dtype)


class SinkhornState(NamedTuple):
  momentum: optax.Updates


def scale_by_sinkhorn(momentum: float, iters: int, tau: float, eps: float, update_rms: float,
                      sub_tables: Mapping[str, Blocks] | None = None
                      ) -> optax.GradientTransformation:
  """Nesterov momentum + Sinkhorn balancing + RMS rescaling; a parameter whose path is in
  `sub_tables` is balanced per block of rows (its sub-tables)."""
  sub_tables = dict(sub_tables or {})

  def init_fn(params):
    return SinkhornState(momentum=table_lib.map_params(lambda _, p: jnp.zeros_like(p), params))

  def update_fn(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda m, g: momentum * m + g, state.momentum, updates)

    def leaf(path, g, m):
      return sinkhorn_direction(g + momentum * m, iters, tau, eps, update_rms, sub_tables.get(path))

    flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
    flat_m = treedef.flatten_up_to(new_m)
    out = [leaf(table_lib.path_str(p), g, m) for (p, g), m in zip(flat_g, flat_m)]
    return jax.tree.unflatten(treedef, out), SinkhornState(momentum=new_m)

  return optax.GradientTransformation(init_fn, update_fn)
