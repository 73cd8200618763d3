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
if it were a separate matrix; rows in no block (the padding) come out zero.

Diagonal form. Every step above only scales rows or columns, so the iterate is always
diag(r) · X₀ · diag(c_b) with X₀ the direction (padding rows zeroed) and c_b the column scales of
row i's block b = b(i): the loop carries r [R] and c [B, C] and never rewrites the table. With
S = X₀² (squared where it is read, never stored), a row step reads X₀ once (Σ_j S_ij c²_bj, c
gathered per row from the small [B, C]) and a column step reads it once (Σ_{i∈b} r_i² S_ij: one
streaming reduction to per-chunk partials and a small one-hot product, `_Blocks`, whose layout is
built once outside the loop); the result is written once at the end. No scatter: on a row-sharded
table (the `engram` axis) each device reduces its own chunks to a partial [B, C] and one
all-reduce of that size follows, and every other statistic is per row. Rows (columns) with zero
RMS get scale 0, so they stay exactly zero and their scale never overflows. X₀ is first scaled by
a power of two (exact) so that its largest entry is near 1 and S neither overflows nor underflows
for ordinary gradient magnitudes; the balancing is invariant to that scale.

Statistics in bfloat16 (`stat_dtype`, `OptimConfig.sinkhorn_stat_dtype`). Every row and column
step reads the table (two reads an alternation, ~26 over the eleven alternations, the lift and the
final rescale), the direction itself only once. With `stat_dtype` bfloat16, S = X₀² is written
once in bfloat16 before the loop and the steps read it (half the bytes of float32 X₀); the
direction is still r · X₀ · c with X₀ in float32. Each stored square is within 2⁻⁸ of its value
relative (bfloat16's 8-bit significand), so every mean square is within 2⁻⁸ and every RMS within
2⁻⁹: r and c each move by about 2⁻⁹ at most, the direction by about 2⁻⁸ (less in practice: the
roundings average over a row's columns and a column's rows; 1.5e-3 at most on 12-column test
tables). float32 (the default) squares X₀ where it is read, as above.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import table as table_lib


Blocks = tuple[tuple[int, int], ...]    # (offset, rows) of each sub-table along axis -2

_HI = jax.lax.Precision.HIGHEST


# Block sums by chunks of rows: the largest chunk that fits (no longer than the smallest block, so a
# chunk meets at most two blocks), at least _MIN_CHUNK rows (below, the partials outweigh the one-hot
# form's [R, B] operand). Long chunks make each block sum one streaming column reduction of the table
# ([R/chunk, chunk, C] over its middle axis) to [R/chunk, C] per side: on the H200 chunks of 43-51
# rows ran that reduction at ~1 TB/s (s3: 21.8 of the Sinkhorn's 32 ms, RESULTS.md). Where no chunk
# fits, the one-hot product over millions of rows is split and padded by XLA inside the loop (m3's
# Engram table 0, 1024 x 4,691 rows, before chunks above 64 rows were allowed: a 2.46 GB pad of X0^2
# at each of 11 column steps). A chunk must lie within one device's rows however the rows are
# sharded: the model pads Engram tables to a multiple of _ROW_GROUPS rows so that they split evenly
# over any power-of-two row group up to that size (`dsv41_jax.engram.lookup.ROW_PAD_MULTIPLE`), so
# the chunk divides R / _ROW_GROUPS (R / the largest power of two up to _ROW_GROUPS that divides R,
# for other tables).
_MIN_CHUNK, _ROW_GROUPS = 8, 1024


def _divisors(n: int) -> list[int]:
  """The divisors of n, ascending."""
  small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
  return sorted(set(small + [n // k for k in small]))


class _Blocks:
  """Which rows (axis −2) form each block: the whole matrix, or each (offset, rows) of `blocks`.

  Block sums go through chunks of `chunk` consecutive rows (at most the smallest block, so a chunk
  meets at most two blocks: that of its first row and the next; size rules above). A sum over the
  rows of each block is one streaming reduction of the table to per-chunk, per-side partials
  [R/chunk, 2, C], then a small one-hot product [B, R/chunk · 2] × [R/chunk · 2, C], exact in
  float32. The layout (each row's side, each (chunk, side)'s block) is built once from iota,
  outside the balancing loop, at 1 byte per row (no table-sized constant, no [R, B] operand). On a
  row-sharded table the chunks stay on their device, so the only collective is the all-reduce of
  the [B, C] result. Where no chunk size fits (`chunk` None), a block sum is the one-hot block
  matmul [B, R] × [R, C] of the row weights times membership. Build inside the traced function
  that uses it."""

  def __init__(self, n_rows: int, blocks: Blocks | None):
    self.whole = blocks is None        # one block of every row: plain reductions
    self.blocks = ((0, n_rows),) if blocks is None else tuple(blocks)
    self.n_rows = n_rows
    self.sizes = np.asarray([n for _, n in self.blocks], np.float32)           # [B]
    per_group = n_rows // math.gcd(n_rows, _ROW_GROUPS)
    fits = [k for k in _divisors(per_group)
            if _MIN_CHUNK <= k <= min(n for _, n in self.blocks)]
    self.chunk = max(fits) if fits and not self.whole else None
    b = len(self.blocks)
    # Block of each row: how many later blocks start at or before it (rows in no block get a
    # neighbour's). One never-reached start keeps the shape non-empty.
    starts = jnp.asarray([o for o, _ in self.blocks[1:]] + [n_rows], jnp.int32)
    block_of = lambda r: jnp.sum((r >= starts).astype(jnp.int32), axis=-1)
    r_RxB = jax.lax.broadcasted_iota(jnp.int32, (n_rows, b), 0)
    self.index = block_of(r_RxB)                                              # [R] int32
    lo = jnp.asarray([o for o, _ in self.blocks], jnp.int32)
    hi = jnp.asarray([o + n for o, n in self.blocks], jnp.int32)
    self.onehot = lambda: ((r_RxB >= lo) & (r_RxB < hi)).astype(jnp.float32)   # [R, B]
    self.inside = jnp.any((r_RxB >= lo) & (r_RxB < hi), axis=-1)             # [R] bool
    if self.chunk is None:
      return
    n, k = n_rows // self.chunk, self.chunk
    first_N = block_of(jax.lax.broadcasted_iota(jnp.int32, (n, b), 0) * k)   # block of row c·k
    side_NxK = self.index.reshape(n, k) - first_N[:, None]                    # 0 or 1
    self.side = jnp.where(self.inside.reshape(n, k), side_NxK, -1).astype(jnp.int8)
    two = jnp.arange(2, dtype=jnp.int32)
    self.owner = ((first_N[:, None, None] + two[:, None]) == jnp.arange(b, dtype=jnp.int32)
                  ).astype(jnp.float32)                                       # [n, 2, B]

  def weighted_column_sums(self, w_R: jax.Array, s_RxC: jax.Array) -> jax.Array:
    """Σ_{i∈b} w_i s_ij for each block b: [..., B, C] (`w_R` [..., R], `s_RxC` [..., R, C])."""
    if self.whole:
      return jnp.sum(w_R[..., None] * s_RxC, axis=-2, keepdims=True)
    if self.chunk is None:
      return jnp.einsum("...rb,...rc->...bc", w_R[..., None] * self.onehot(), s_RxC, precision=_HI)
    n, k = self.n_rows // self.chunk, self.chunk
    w = w_R.reshape(*w_R.shape[:-1], n, k, 1)
    s = s_RxC.reshape(*s_RxC.shape[:-2], n, k, s_RxC.shape[-1])
    # One reduction per side, each [..., n, k, C] over k (siblings over the same read of the table),
    # rather than one over a [..., n, k, 2, C] broadcast.
    partial = jnp.stack([jnp.sum(jnp.where(self.side[:, :, None] == side, w * s, 0.0), axis=-2)
                         for side in (0, 1)], axis=-2)                         # [..., n, 2, C]
    return jnp.einsum("...nsc,nsb->...bc", partial, self.owner, precision=_HI)

  def mean_of_rows(self, v_R: jax.Array) -> jax.Array:
    """Mean of `v` [..., R] over the rows of each block: [..., B]."""
    if self.whole:
      return jnp.mean(v_R, axis=-1, keepdims=True)
    return self.weighted_column_sums(v_R, jnp.ones(v_R.shape[-1:] + (1,), v_R.dtype))[..., 0] / (
        self.sizes)


class _Balanced(NamedTuple):
  """A balanced matrix as diag(r) · X₀ · diag(c_b) (module docstring)."""
  x0: jax.Array       # [..., R, C] float32, rows in no block zero, scaled by a power of two
  r: jax.Array        # [..., R]
  c: jax.Array        # [..., B, C]
  index: jax.Array    # [R] block of each row
  s: jax.Array | None = None   # X₀² as stored for the statistics (None: squared where read)

  def row_ms(self) -> jax.Array:
    """Mean square of each row [..., R]."""
    c2_RxC = jnp.take(jnp.square(self.c), self.index, axis=-2)
    return jnp.square(self.r) * jnp.mean(_squares(self.x0, self.s) * c2_RxC, axis=-1)

  def value(self, row_factor_B: jax.Array | None = None) -> jax.Array:
    """The matrix itself (each row further × its block's `row_factor_B`, if given)."""
    r = self.r if row_factor_B is None else self.r * jnp.take(row_factor_B, self.index, axis=-1)
    return r[..., None] * self.x0 * jnp.take(self.c, self.index, axis=-2)


def _scale_where_nonzero(ms: jax.Array, floor: jax.Array) -> jax.Array:
  """max(rms, floor) / rms, the lift to the floor; 0 where the mean square is 0."""
  rms = jnp.sqrt(ms)
  return jnp.where(ms > 0, jnp.maximum(rms, floor) / jnp.where(ms > 0, rms, 1.0), 0.0)


STAT_DTYPES = ("float32", "bfloat16")


def check_stat_dtype(stat_dtype: str) -> None:
  """ValueError naming STAT_DTYPES unless `stat_dtype` is one of them."""
  if stat_dtype not in STAT_DTYPES:
    raise ValueError(f"sinkhorn stat_dtype {stat_dtype!r} is not one of {', '.join(STAT_DTYPES)}")


def _stored_squares(x0: jax.Array, stat_dtype: str) -> jax.Array | None:
  """X₀² as the statistics read it: None (squared where read) for float32, else written once in
  `stat_dtype`."""
  check_stat_dtype(stat_dtype)
  return None if stat_dtype == "float32" else jnp.square(x0).astype(jnp.dtype(stat_dtype))


def _squares(x0: jax.Array, s: jax.Array | None) -> jax.Array:
  """S = X₀² in float32: from the stored squares `s` if any, else from X₀."""
  return jnp.square(x0) if s is None else s.astype(jnp.float32)


def _balance(d_RxC: jax.Array, iters: int, tau: float, eps: float, blk: _Blocks,
             stat_dtype: str = "float32") -> _Balanced:
  """The balanced direction in diagonal form (statistics from X₀² in `stat_dtype`)."""
  x0 = jnp.where(blk.inside[:, None], d_RxC.astype(jnp.float32), 0.0)
  peak = jnp.max(jnp.abs(x0), axis=(-2, -1), keepdims=True)
  _, exponent = jnp.frexp(jnp.where(peak > 0, peak, 1.0))
  x0 = jnp.ldexp(x0, -exponent)                        # exact: max |X₀| in [0.5, 1)
  index = blk.index
  s = _stored_squares(x0, stat_dtype)

  def row_ms(r, c):
    return _Balanced(x0, r, c, index, s).row_ms()

  def col_ms(r, c):      # mean square of each column of each block  [..., B, C]
    return (jnp.square(c) * blk.weighted_column_sums(jnp.square(r), _squares(x0, s))
            / blk.sizes[:, None])

  def row_floor(rms_R):  # τ × the mean row RMS of the row's block  [..., R]
    return jnp.take(tau * blk.mean_of_rows(rms_R), index, axis=-1)

  def col_floor(rms_BxC):
    return tau * jnp.mean(rms_BxC, axis=-1, keepdims=True)

  # The lift: rows, then columns, raised to the floor (scale ≥ 1; zero rows / columns get 0,
  # which keeps them zero through the loop).
  ones_BxC = jnp.ones(x0.shape[:-2] + (len(blk.blocks), x0.shape[-1]), jnp.float32)
  ms = row_ms(jnp.ones(x0.shape[:-1], jnp.float32), ones_BxC)
  lift_r = _scale_where_nonzero(ms, row_floor(jnp.sqrt(ms)))
  ms = col_ms(lift_r, ones_BxC)
  lift_c = _scale_where_nonzero(ms, col_floor(jnp.sqrt(ms)))

  def alternation(_, rc):
    r, c = rc
    rms = jnp.sqrt(row_ms(r, c))
    r = r / jnp.maximum(jnp.maximum(rms, row_floor(rms)), eps)      # each row by its RMS
    rms = jnp.sqrt(col_ms(r, c))
    c = c / jnp.maximum(jnp.maximum(rms, col_floor(rms)), eps)      # each column of each block
    return r, c

  # A loop, not unrolled: the compiled update keeps one alternation body per parameter.
  r, c = jax.lax.fori_loop(0, iters, alternation, (lift_r, lift_c))
  unlift = lambda v, lift: v / jnp.where(lift > 0, lift, 1.0)      # divide the lift out
  return _Balanced(x0, unlift(r, lift_r), unlift(c, lift_c), index, s)


def sinkhorn_balance(d_RxC: jax.Array, iters: int, tau: float, eps: float,
                     blocks: Blocks | None = None, stat_dtype: str = "float32") -> jax.Array:
  """K alternations of row then column RMS normalization (float32), batched over leading axes,
  with starved rows / columns kept at their floored relative size; each block of rows on its own
  when `blocks` is given; the statistics from X₀² stored in `stat_dtype` (module docstring)."""
  return _balance(d_RxC, iters, tau, eps, _Blocks(d_RxC.shape[-2], blocks), stat_dtype).value()


def sinkhorn_direction(d: jax.Array, iters: int, tau: float, eps: float, update_rms: float,
                       blocks: Blocks | None = None, stat_dtype: str = "float32") -> jax.Array:
  """`sinkhorn_balance`, then each matrix (each block of rows, if given) scaled to RMS
  `update_rms`; an all-zero matrix stays zero. The table is written once, in `d`'s dtype."""
  blk = _Blocks(d.shape[-2], blocks)
  balanced = _balance(d, iters, tau, eps, blk, stat_dtype)
  rms_B = jnp.sqrt(blk.mean_of_rows(balanced.row_ms()))
  return balanced.value(update_rms / jnp.maximum(rms_B, eps)).astype(d.dtype)


class SinkhornState(NamedTuple):
  momentum: optax.Updates


def scale_by_sinkhorn(momentum: float, iters: int, tau: float, eps: float, update_rms: float,
                      sub_tables: Mapping[str, Blocks] | None = None, stat_dtype: str = "float32"
                      ) -> optax.GradientTransformation:
  """Nesterov momentum + Sinkhorn balancing + RMS rescaling; a parameter whose path is in
  `sub_tables` is balanced per block of rows (its sub-tables); statistics from X₀² stored in
  `stat_dtype` (module docstring)."""
  sub_tables = dict(sub_tables or {})
  check_stat_dtype(stat_dtype)           # a bad name fails here, not at the first update

  def init_fn(params):
    return SinkhornState(momentum=table_lib.map_params(lambda _, p: jnp.zeros_like(p), params))

  def update_fn(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda m, g: momentum * m + g, state.momentum, updates)

    def leaf(path, g, m):
      return sinkhorn_direction(g + momentum * m, iters, tau, eps, update_rms, sub_tables.get(path),
                                stat_dtype)

    flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
    flat_m = treedef.flatten_up_to(new_m)
    out = [leaf(table_lib.path_str(p), g, m) for (p, g), m in zip(flat_g, flat_m)]
    return jax.tree.unflatten(treedef, out), SinkhornState(momentum=new_m)

  return optax.GradientTransformation(init_fn, update_fn)
