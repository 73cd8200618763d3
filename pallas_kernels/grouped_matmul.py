"""Grouped GEMM for the routed experts, forward and backward (docs/design.md §8.2; §T5, §T7).

The kernel of the op `grouped_matmul` (`pallas_kernels.ops.grouped_matmul`; `mosaic_grouped_matmul`
below): with group g owning
rows [s_g, s_g + n_g) of x, s_g = Σ_{g'<g} n_g',

  y[r]     = x[r] · w[g(r)]          [M, K] × [G, K, N] -> [M, N] float32 (or x's dtype: `out_dtype`,
                                     the float32 accumulator rounded once); rows past Σ n_g are 0
  dx[r]    = dy[r] · w[g(r)]ᵀ        input gradient  -> [M, K] in x's dtype
  dw[g]    = x_gᵀ · dy_g             weight gradient -> [G, K, N] in w's dtype (0 for empty groups)

joined by one `jax.custom_vjp`. The cotangent is rounded to x's dtype once (a no-op for an output
in x's dtype, whose cotangent already is), before both backward products (the tensor cores take bf16 operands); each product accumulates in float32 and
rounds once at the end, as `jax.grad` of `ragged_dot` rounds its gradients to the primal dtypes.
No product ever builds a dense per-group [G, C, ·] buffer.

Two implementations of the three products behind the same custom VJP (`Plan.backend`):
- "xla": `jax.lax.ragged_dot` / `ragged_dot_general`. Exact, runs anywhere; the CPU tests check the
  custom VJP with it against `jax.grad` of `ragged_dot` and a per-group float64 loop.
- "mosaic_gpu": Pallas Mosaic GPU kernels for Hopper (wgmma from shared memory, TMA pipelines,
  persistent over the SMs); the tests run them in Mosaic GPU interpret mode on CPU.

Kernels:
- `_gmm_kernel` (forward, and the input gradient with w read transposed): work items are
  (row tile, column tile). A row tile is one block of `block_m` rows *of one group*: a block that
  straddles a boundary is visited once per group and each visit stores only its own rows (TMA
  stores of 2^i rows, a ladder as in jax's `ragged_dot_mgpu`). The tile map (group, block, first
  and last row per tile) is computed by XLA from the group sizes, so the kernel has no per-group
  unrolled code and no limit on the number of groups; the tail [Σ n_g, M) is one more "group" whose
  tiles store zeros. At most ceil(M / block_m) + G row tiles exist.
- `_gmm_ws_kernel` (the same two products when the product's `TileConfig.compute_wgs` is 2):
  warp-specialized, one producer warpgroup issuing the TMA loads and two consumer warpgroups, each
  with a block_m × block_n accumulator of a block_m × 2·block_n tile; items run row-major so the
  real groups' tiles come first, and each program's consecutive product items are one chain of
  pipelines (the producer loads the next item's first blocks while the consumers store).
- `_tgmm_kernel` (weight gradient): work items are (group, output tile); the K loop walks the
  group's rows in blocks of `block_k` from the block-aligned start, and the first and last block
  have the rows of neighbouring groups selected to zero in both operands before the wgmma.
- `_tgmm_ws_kernel` (the weight gradient when `TileConfig.compute_wgs` is 2): the same items with
  block_m × 2·block_n output tiles, a producer warpgroup and two consumers of one half each; one
  pipeline per item (groups differ in their number of row blocks), the same sums in the same
  order as `_tgmm_kernel` (bit for bit the same output).

Bad input never gives a silently wrong product: group sizes that are negative or sum past M make
every output NaN (concrete sizes raise a ValueError before that). What the kernels cannot take
(no Hopper GPU, non-16-bit dtypes, K or N not multiples of the blocks) is named by
`unsupported_reason`; under the policy "auto" the dispatcher then runs the op's reference
(`ragged_dot`) and logs it once. The number of groups has no limit: nothing is unrolled per group.

Measured on the H200 (jax 0.11.2, docs/design.md §T7 shape, skewed routing; benchmarks/RESULTS.md):
forward 328, input grad 335, weight grad 365 useful TFLOP/s; forward+backward through the custom
VJP 349 TFLOP/s (1.995 ms), exact against float32 references (relative errors 1.6e-6, 6.1e-5,
1.4e-4 for y, dx, dw, the last two against bf16-rounded references). The 450 TFLOP/s goal is not
reached: one warpgroup per 128×128 tile and a float32 output tile that caps the forward pipeline
at 4 stages are the likely limits (jax's ragged_dot_mgpu, bf16 out, 6 stages: 521 forward).
The warp-specialized kernel (session 71, one H100, bf16 out, s3's and m3's expert shapes): forward
387-578 and input gradient 408-526 useful TFLOP/s against the single-warpgroup kernel's 292-429 and
342-369, the same output bit for bit; the default for both since.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BACKENDS = ("xla", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Block sizes of one kernel. block_m × block_n is the wgmma accumulator (one warpgroup)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4   # TMA pipeline depth (shared memory: see `smem_bytes`)
  grid_block_n: int = 1           # column tiles per snake band (L2 reuse of x's row blocks)
  # 2: the warp-specialized kernels (`_gmm_ws_kernel`, `_tgmm_ws_kernel`): a producer warpgroup
  # issues the TMA loads, two consumer warpgroups each own a block_m x block_n accumulator of a
  # block_m x 2·block_n tile; in the row-tile products consecutive tiles of a program run as one
  # chained pipeline (loads of the next tile overlap this tile's epilogue).
  compute_wgs: int = 1


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static choices of one grouped matmul: which products, with which blocks."""
  backend: str = "mosaic_gpu"
  # The fastest of each product's sweep on the H200 (benchmarks/RESULTS.md, "Grouped GEMM").
  forward: TileConfig = TileConfig(max_concurrent_steps=4, grid_block_n=2)       # float32 out
  # The forward with its output in x's dtype (`out_dtype`, as the experts run it) and the input
  # gradient: the warp-specialized kernel, 4 deep (benchmarks/grouped_ws_gpu.py, session 71, one
  # H100: 1.13-1.47x the single-warpgroup kernel's 6-deep, band-2 blocks at s3's and m3's expert
  # shapes, bit for bit the same output; where n is not a multiple of 256 those blocks run
  # single-warpgroup, `warp_specialized`).
  forward_narrow: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2)  # bf16 out
  input_grad: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2)      # bf16 out
  weight_grad: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=1)   # bf16 out
  num_sms: int | None = None      # persistent programs; None = the device's SM count
  interpret: bool = False         # Mosaic GPU interpret mode (CPU tests)


SMEM_LIMIT_BYTES = 227 * 1024     # Hopper: the most dynamic shared memory one block may take


def _epi_rows(cfg: TileConfig, out_bytes: int) -> int:
  """Rows of the warp-specialized kernel's output staging tile per consumer: 16 KiB of block_n
  columns (64 rows of bf16 at block_n 128, 32 of float32), stored a chunk at a time."""
  return max(8, min(cfg.block_m, 16384 // (cfg.block_n * out_bytes)))


def smem_bytes(cfg: TileConfig, in_bytes: int, out_bytes: int) -> int:
  """Shared memory of one program: `max_concurrent_steps` pairs of operand blocks (bm×bk and
  bk×bn; bk×bm and bk×bn for the weight gradient) + the bm×bn output staging tile (the
  warp-specialized kernel: bm×bk and bk×2bn blocks, one epilogue chunk per consumer; a config
  asking for it needs both, since its blocks run single-warpgroup where N is off 2bn)."""
  per_step = cfg.block_k * (cfg.block_m + cfg.block_n) * in_bytes
  single = cfg.max_concurrent_steps * per_step + cfg.block_m * cfg.block_n * out_bytes
  if cfg.compute_wgs != 2:
    return single
  per_step = cfg.block_k * (cfg.block_m + 2 * cfg.block_n) * in_bytes
  staging = 2 * _epi_rows(cfg, out_bytes) * cfg.block_n * out_bytes
  return max(single, cfg.max_concurrent_steps * per_step + staging)


def unsupported_reason(x_MxK, w_GxKxN, plan: Plan = Plan()) -> str | None:
  """Why the Mosaic GPU kernels cannot take these operands here (None: they can).

  Needs a Hopper GPU (compute capability 9.x) unless `plan.interpret`; bf16/f16 operands of one
  dtype; N and K multiples of the column blocks and contracting blocks (the row count M is free).
  """
  if not plan.interpret:
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", ""))
    if dev.platform != "gpu" or not cc.startswith("9."):
      return f"needs a Hopper GPU (wgmma), not {dev.platform} {getattr(dev, 'device_kind', '')}"
  m, k = x_MxK.shape
  g, k2, n = w_GxKxN.shape
  if k != k2:
    return f"contracting sizes differ: x {x_MxK.shape}, w {w_GxKxN.shape}"
  if x_MxK.dtype != w_GxKxN.dtype or x_MxK.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtypes {x_MxK.dtype}/{w_GxKxN.dtype}: the wgmma kernels take bf16 or f16 operands"
  for name, cfg, (rows, cols, red) in (("forward", plan.forward, (m, n, k)),
                                       ("forward_narrow", plan.forward_narrow, (m, n, k)),
                                       ("input_grad", plan.input_grad, (m, k, n)),
                                       ("weight_grad", plan.weight_grad, (k, n, m))):
    if cfg.compute_wgs not in (1, 2):
      return f"{name}: compute_wgs {cfg.compute_wgs} (1, or 2: warp-specialized)"
    if cols % cfg.block_n or (name == "weight_grad" and rows % cfg.block_m):
      return f"{name}: output dims ({rows}, {cols}) not multiples of blocks {cfg}"
    if name != "weight_grad" and red % cfg.block_k:
      return f"{name}: contracting dim {red} is not a multiple of block_k {cfg.block_k}"
    if cfg.block_m % 64 or cfg.block_n % 64 or cfg.block_k % 64:
      return f"{name}: blocks must be multiples of 64 ({cfg})"
    if name != "weight_grad" and cfg.max_concurrent_steps < 2:
      return f"{name}: max_concurrent_steps must be >= 2 (the wgmma releases its slot a step late)"
  out_bytes = {"forward": 4, "forward_narrow": 2, "input_grad": 2, "weight_grad": 2}
  for name in out_bytes:
    cfg = getattr(plan, name)
    need = smem_bytes(cfg, 2, out_bytes[name])
    if need > SMEM_LIMIT_BYTES:
      return f"{name}: {need} bytes of shared memory > {SMEM_LIMIT_BYTES} ({cfg})"
  if m >= 2**31 // max(k, n) or g * m >= 2**31:
    return f"sizes ({m}, {k}, {n}, {g}) overflow int32 indexing"
  return None


# --- group bookkeeping (XLA, tiny) --------------------------------------------------------------

def _bad_sizes(group_sizes_G, m: int):
  """True when a size is negative or they sum past the row count (checked without overflow)."""
  gs = group_sizes_G.astype(jnp.int32)
  return jnp.any(gs < 0) | jnp.any(gs > m) | (jnp.sum(jnp.clip(gs, 0, m)) > m)


def _fill(bad):
  """What every output element gets added: 0, or NaN when the group sizes are bad."""
  return jnp.where(bad, jnp.nan, 0.0).astype(jnp.float32).reshape(1)


def _bounds(group_sizes_G, bad):
  sizes = jnp.where(bad, 0, group_sizes_G.astype(jnp.int32))
  ends = jnp.cumsum(sizes)
  return ends - sizes, ends


def _row_tiles(group_sizes_G, m: int, block_m: int, bad):
  """Tile map of the forward kernel: (group, block, first row, end row) per row tile, int32 [T].

  Groups are the G real ones plus the tail [Σ n_g, M) as group G (all of [0, M) when `bad`).
  Unused tiles get first = end = 0 and store nothing.
  """
  g = group_sizes_G.shape[0]
  starts, ends = _bounds(group_sizes_G, bad)
  total = jnp.where(bad, 0, ends[-1])
  starts = jnp.concatenate([starts, total[None]])
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  first = starts // block_m
  count = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
  tile_end = jnp.cumsum(count)
  n_tiles = -(-m // block_m) + g
  t = jnp.arange(n_tiles, dtype=jnp.int32)
  grp = jnp.sum(tile_end[None, :] <= t[:, None], axis=1).astype(jnp.int32)
  live = grp <= g
  grp = jnp.minimum(grp, g)
  blk = first[grp] + t - (tile_end - count)[grp]
  lo = jnp.clip(starts[grp] - blk * block_m, 0, block_m)
  hi = jnp.clip(ends[grp] - blk * block_m, 0, block_m)
  zero = jnp.zeros_like(t)
  return grp, jnp.where(live, blk, zero), jnp.where(live, lo, zero), jnp.where(live, hi, zero)


def _group_blocks(group_sizes_G, bad, block_k: int):
  """The weight-gradient kernels' per-group rows, int32 [G] each: first row, end row, the first
  row rounded down to a block, and the number of `block_k`-row blocks from there (0: empty)."""
  starts, ends = _bounds(group_sizes_G, bad)
  n_blocks = jnp.where(ends > starts, -(-ends // block_k) - starts // block_k, 0)
  return starts, ends, (starts // block_k * block_k).astype(jnp.int32), n_blocks.astype(jnp.int32)


def _group_rows(start_ref, end_ref, first_ref, nblk_ref, gi, block_k: int, m: int):
  """Inside a weight-gradient kernel, group `gi`'s (blocks, first kept row of its first block,
  last kept row of its last block, the rows from its block-aligned start: may run past M, never
  read there)."""
  from jax.experimental import pallas as pl
  return (nblk_ref[gi], lax.rem(start_ref[gi], block_k), lax.rem(end_ref[gi] - 1, block_k),
          pl.ds(pl.multiple_of(first_ref[gi], block_k), m))


# --- the "xla" products --------------------------------------------------------------------------

_F32 = jnp.float32


def _rows_live(y_MxN, group_sizes_G, bad):
  total = jnp.sum(group_sizes_G.astype(jnp.int32))
  live = jnp.arange(y_MxN.shape[0])[:, None] < total
  return jnp.where(bad, jnp.nan, jnp.where(live, y_MxN, 0))


def _xla_forward(x_MxK, w_GxKxN, group_sizes_G, out_dtype=_F32):
  bad = _bad_sizes(group_sizes_G, x_MxK.shape[0])
  y = lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G, preferred_element_type=_F32)
  return _rows_live(y, group_sizes_G, bad).astype(out_dtype)


def _xla_input_grad(dy_MxN, w_GxKxN, group_sizes_G):
  bad = _bad_sizes(group_sizes_G, dy_MxN.shape[0])
  dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  dx = lax.ragged_dot_general(dy_MxN, w_GxKxN, group_sizes_G, dims, preferred_element_type=_F32)
  return _rows_live(dx, group_sizes_G, bad).astype(dy_MxN.dtype)


def _xla_weight_grad(x_MxK, dy_MxN, group_sizes_G):
  bad = _bad_sizes(group_sizes_G, x_MxK.shape[0])
  dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  dw = lax.ragged_dot_general(x_MxK, dy_MxN, group_sizes_G, dims, preferred_element_type=_F32)
  return jnp.where(bad, jnp.nan, dw).astype(x_MxK.dtype)


# --- the Mosaic GPU kernels ----------------------------------------------------------------------

def _plgpu():
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only module: imported on use
  return plgpu


def _kernel_kwargs(plan: Plan):
  plgpu = _plgpu()
  if plan.interpret:
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:  # jax 0.10 keeps it private
      from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    interpret, num_sms = params(), plan.num_sms or 4
  else:
    interpret, num_sms = None, plan.num_sms or jax.devices()[0].core_count
  return dict(grid=(num_sms,), grid_names=("sm",), interpret=interpret,
              compiler_params=plgpu.CompilerParams(
                  lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def _wgmma(acc_ref, a_smem, b_smem, *, transpose_a: bool, transpose_b: bool, interpret: bool):
  """acc += op(a) · op(b) from shared memory, op = transpose where asked.

  On the GPU the transposes are views of the refs (wgmma reads either major order). jax 0.10's
  interpret mode cannot read a transposed ref in wgmma, so there the block is staged transposed
  through a scratch buffer first; the product is the same.
  """
  plgpu = _plgpu()
  if not interpret:
    plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)) if transpose_a else a_smem,
                b_smem.transpose((1, 0)) if transpose_b else b_smem)
    return
  from jax.experimental import pallas as pl
  src = a_smem if transpose_a else b_smem
  assert transpose_a != transpose_b

  def staged(t_smem):
    t_smem[...] = src[...].T
    plgpu.wgmma(acc_ref, t_smem if transpose_a else a_smem, b_smem if transpose_a else t_smem)

  pl.run_scoped(staged, plgpu.SMEM(src.shape[::-1], src.dtype))


def _operand_transforms(dtype):
  """The operand blocks' shared-memory layout, as jax's Hopper matmul writes it (rows of 8, the
  minor dim in swizzled 128-byte lines), stated rather than inferred."""
  plgpu = _plgpu()
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(64 * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _keep_rows(smem, keep, interpret: bool):
  """Zero the rows of a staged block for which keep(row) is False (a select, so NaN can't leak)."""
  plgpu = _plgpu()
  vals = smem[...]
  ids = lax.broadcasted_iota(jnp.int32, vals.shape, 0)
  if not interpret:
    ids = plgpu.layout_cast(ids, plgpu.Layout.WGMMA)
  smem[...] = jnp.where(keep(ids), vals, jnp.zeros_like(vals))
  plgpu.commit_smem()


def _snake(lin, rows: int, cols: int, band: int):
  """Work item -> (row, col): bands of `band` columns (band | cols), rows walked down one band and
  up the next, columns fastest inside a band, so consecutive items share row blocks in L2."""
  per_band = band * rows
  b = lax.div(lin, jnp.int32(per_band))
  within = lax.rem(lin, jnp.int32(per_band))
  row = lax.div(within, jnp.int32(band))
  row = jnp.where(lax.rem(b, jnp.int32(2)) == 0, row, rows - 1 - row)
  return row, b * band + lax.rem(within, jnp.int32(band))


def _store_rows(o_smem, o_gmem, lo, hi, row0, col0, block_m: int, block_n: int, m: int,
                wait: bool = True):
  """TMA-store rows [lo, hi) of the staged tile to o_gmem[row0 + lo :, col0 :], 2^i rows a copy;
  `wait`: until the copies have read the tile (else the caller waits before reusing it)."""
  plgpu = _plgpu()
  from jax.experimental import pallas as pl
  size = hi - lo
  start = lo
  rows = min(block_m, m)
  while rows > 0:
    step = 1 << int(math.log2(rows))
    rows //= 2

    @pl.when(size & step != 0)
    def _():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, step)],
                              o_gmem.at[pl.ds(row0 + start, step), pl.ds(col0, block_n)])

    start = start + (size & step)
  if wait:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gmm_kernel(x_MxK, w, tiles, fill, *, transpose_w: bool, out_dtype, cfg: TileConfig,
                plan: Plan):
  """y[r] = x[r] · w[g(r)] (w [G, K, N]) or x[r] · w[g(r)]ᵀ (transpose_w, w [G, N, K])."""
  plgpu = _plgpu()
  from jax.experimental import pallas as pl
  m, k = x_MxK.shape
  g = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid_n = n // bn
  n_tiles = tiles[0].shape[0]
  band = cfg.grid_block_n if grid_n % cfg.grid_block_n == 0 else 1

  def body(grp_ref, blk_ref, lo_ref, hi_ref, fill_ref, x_gmem, w_gmem, o_gmem):
    @plgpu.nd_loop((n_tiles * grid_n,), collective_axes="sm")
    def _(info):
      mi, ni = _snake(info.index[0], n_tiles, grid_n, band)
      grp, blk, lo, hi = grp_ref[mi], blk_ref[mi], lo_ref[mi], hi_ref[mi]

      def acc_scope(acc_ref):
        def step(_, x_smem, w_smem):
          if transpose_w:
            _wgmma(acc_ref, x_smem, w_smem, transpose_a=False, transpose_b=True,
                   interpret=plan.interpret)
          else:
            plgpu.wgmma(acc_ref, x_smem, w_smem)

        @pl.when((grp < g) & (hi > lo))
        def _():
          w_spec = (plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=1)
                    if transpose_w else
                    plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1))
          plgpu.emit_pipeline(
              step, grid=(k // bk,),
              in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (blk, kk), delay_release=1), w_spec],
              max_concurrent_steps=cfg.max_concurrent_steps,
          )(x_gmem, w_gmem.at[jnp.minimum(grp, g - 1)])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn))) + fill_ref[0]

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=out_dtype))
      def _(o_smem):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        _store_rows(o_smem, o_gmem, lo, hi, blk * bm, ni * bn, bm, bn, m)

  call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), **_kernel_kwargs(plan))
  return call(*tiles, fill, x_MxK, w)


def _chain_stages(k_steps: int, most: int) -> int:
  """Pipeline depth of the chained kernel: the largest depth <= `most` dividing the K steps (a
  chain of pipelines keeps its slots aligned only then)."""
  return max(d for d in range(1, min(most, k_steps) + 1) if k_steps % d == 0)


def _gmm_ws_kernel(x_MxK, w, tiles, n_gemm, fill, *, transpose_w: bool, out_dtype,
                   cfg: TileConfig, plan: Plan):
  """`_gmm_kernel`'s product, warp-specialized (TileConfig.compute_wgs == 2).

  Work items are (row tile, column tile of 2·block_n), row-major, so the items of the real groups'
  row tiles (the first `n_gemm` of the tile map) come first and the tail group's fill tiles after.
  Warpgroup 2 issues the TMA loads; warpgroups 0 and 1 multiply one block_n half each, add the
  fill and store their half's rows [lo, hi) in chunks of `_epi_rows`. A program's consecutive
  product items form one chain of pipelines (START, STEADY..., STOP; a lone item runs a plain
  pipeline), so the producer fetches the next item's first blocks while the consumers store.
  """
  plgpu = _plgpu()
  from jax.experimental import pallas as pl
  m, k = x_MxK.shape
  g = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid_n = n // (2 * bn)
  n_tiles = tiles[0].shape[0]
  n_items = n_tiles * grid_n
  k_steps = k // bk
  stages = _chain_stages(k_steps, cfg.max_concurrent_steps)
  out_bytes = jnp.dtype(out_dtype).itemsize
  epi = _epi_rows(cfg, out_bytes)
  num_sms = _kernel_kwargs(plan)["grid"][0]
  state = plgpu.PipelinePipeline
  # The layout stated (the consumers slice the w block at a dynamic offset).
  transforms = _operand_transforms(x_MxK.dtype)

  def pipeline(mma, context, blk, ni, chain):
    if transpose_w:
      w_spec = plgpu.BlockSpec((2 * bn, bk), lambda kk: (ni, kk), transforms=transforms)
    else:
      w_spec = plgpu.BlockSpec((bk, 2 * bn), lambda kk: (kk, ni), transforms=transforms)
    return plgpu.emit_pipeline_warp_specialized(
        mma, grid=(k_steps,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (blk, kk), transforms=transforms),
                  w_spec],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages,
        compute_context=context, pipeline_state=chain)

  def body(grp_ref, blk_ref, lo_ref, hi_ref, ngemm_ref, fill_ref, x_gmem, w_gmem, o_gmem):
    zero = jnp.int32(0)   # the allocations depend on the blocks' shapes only
    allocs = pipeline(None, None, zero, zero, None).get_allocations(x_gmem, w_gmem.at[0])

    # Interpret mode cannot read a transposed block in wgmma (`_wgmma`): there each consumer
    # stages its transposed half of the w block here (a scoped allocation must span the threads).
    staged = plgpu.SMEM((2, bk, bn), x_MxK.dtype) if transpose_w and plan.interpret else None

    @functools.partial(pl.run_scoped, pipeline_allocs=allocs,
                       o_smem=plgpu.SMEM((2, epi, bn), out_dtype), t_smem=staged,
                       collective_axes="wg")
    def _(pipeline_allocs, o_smem, t_smem):
      wg = lax.axis_index("wg")
      n_live = ngemm_ref[0] * grid_n      # product items: a prefix of the item order

      def store(acc, lo, hi, row0, col0):
        """Consumer `wg`'s half tile: rows [lo, hi) of acc to o_gmem[row0 :, col0 :]."""
        for c in range(bm // epi):
          c_lo = jnp.clip(lo - c * epi, 0, epi)
          c_hi = jnp.clip(hi - c * epi, 0, epi)

          @pl.when(c_hi > c_lo)
          def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last chunk's copies read it
            o_smem[wg] = acc[c * epi:(c + 1) * epi].astype(out_dtype)
            plgpu.commit_smem()
            _store_rows(o_smem.at[wg], o_gmem, c_lo, c_hi, row0 + c * epi, col0, epi, bn, m,
                        wait=False)

      @plgpu.nd_loop((n_items,), collective_axes="sm")
      def _(info):
        lin = info.index[0]
        mi, ni = lax.div(lin, jnp.int32(grid_n)), lax.rem(lin, jnp.int32(grid_n))
        grp, blk, lo, hi = grp_ref[mi], blk_ref[mi], lo_ref[mi], hi_ref[mi]
        row0, col0 = blk * bm, ni * (2 * bn) + wg * bn

        def mma(_, x_smem, w_smem, acc_ref):
          if transpose_w and plan.interpret:
            t_smem[wg] = w_smem[pl.ds(wg * bn, bn), :].T
            plgpu.wgmma(acc_ref, x_smem, t_smem.at[wg])
          elif transpose_w:
            plgpu.wgmma(acc_ref, x_smem, w_smem.at[pl.ds(wg * bn, bn), :].transpose((1, 0)))
          else:
            plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * bn, bn)])
          plgpu.wgmma_wait(0)
          return acc_ref

        def context(run):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
          def _(acc_ref):
            run(acc_ref)
            store(acc_ref[...] + fill_ref[0], lo, hi, row0, col0)

        first, last = lin < num_sms, lin + num_sms >= n_live
        w_g = w_gmem.at[jnp.minimum(grp, g - 1)]
        chained = jnp.where(first, int(state.START), jnp.where(last, int(state.STOP),
                                                                 int(state.STEADY)))

        @pl.when((lin < n_live) & ~(first & last))
        def _():
          pipeline(mma, context, blk, ni, chained)(x_gmem, w_g, allocations=pipeline_allocs)

        @pl.when((lin < n_live) & first & last)
        def _():
          pipeline(mma, context, blk, ni, None)(x_gmem, w_g, allocations=pipeline_allocs)

        @pl.when((lin >= n_live) & (hi > lo) & (wg < 2))
        def _():   # the tail group's rows: the fill (0, or NaN for bad group sizes)
          acc = pl.run_scoped(lambda acc_ref: acc_ref[...], plgpu.ACC((bm, bn), jnp.float32))
          store(acc + fill_ref[0], lo, hi, row0, col0)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kwargs = _kernel_kwargs(plan)
  call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), num_threads=3,
                      thread_name="wg", **kwargs)
  return call(*tiles, n_gemm, fill, x_MxK, w)


def _tgmm_kernel(x_MxK, dy_MxN, group_sizes_G, fill, *, out_dtype, cfg: TileConfig, plan: Plan,
                 bad):
  """dw[g] = x_gᵀ · dy_g over each group's rows, [G, K, N]."""
  plgpu = _plgpu()
  from jax.experimental import pallas as pl
  m, k = x_MxK.shape
  n = dy_MxN.shape[1]
  g = group_sizes_G.shape[0]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid_m, grid_n = k // bm, n // bn
  band = cfg.grid_block_n if grid_n % cfg.grid_block_n == 0 else 1
  blocks = _group_blocks(group_sizes_G, bad, bk)
  transforms = _operand_transforms(x_MxK.dtype)

  def body(start_ref, end_ref, first_ref, nblk_ref, fill_ref, x_gmem, dy_gmem, o_gmem):
    @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
    def _(info):
      gi = info.index[0]
      mi, ni = _snake(info.index[1], grid_m, grid_n, band)
      nblk, lo, last, rows = _group_rows(start_ref, end_ref, first_ref, nblk_ref, gi, bk, m)

      def acc_scope(acc_ref):
        def step(idx, x_smem, dy_smem):
          i = idx[0]

          @pl.when(i == 0)
          def _():
            _keep_rows(x_smem, lambda r: r >= lo, plan.interpret)
            _keep_rows(dy_smem, lambda r: r >= lo, plan.interpret)

          @pl.when(i == nblk - 1)
          def _():
            _keep_rows(x_smem, lambda r: r <= last, plan.interpret)
            _keep_rows(dy_smem, lambda r: r <= last, plan.interpret)

          _wgmma(acc_ref, x_smem, dy_smem, transpose_a=True, transpose_b=False,
                 interpret=plan.interpret)
          if cfg.max_concurrent_steps == 1:
            plgpu.wgmma_wait(0)  # no delayed release: the slot is refilled right after

        @pl.when(nblk > 0)
        def _():
          delay = 1 if cfg.max_concurrent_steps > 1 else 0
          plgpu.emit_pipeline(
              step, grid=(nblk,),
              in_specs=[plgpu.BlockSpec((bk, bm), lambda i: (i, mi), delay_release=delay,
                                        transforms=transforms),
                        plgpu.BlockSpec((bk, bn), lambda i: (i, ni), delay_release=delay,
                                        transforms=transforms)],
              max_concurrent_steps=cfg.max_concurrent_steps,
          )(x_gmem.at[rows, :], dy_gmem.at[rows, :])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn))) + fill_ref[0]

      @functools.partial(pl.run_scoped,
                         o_smem=plgpu.SMEM((bm, bn), dtype=out_dtype, transforms=transforms))
      def _(o_smem):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[gi, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
                      **_kernel_kwargs(plan))
  return call(*blocks, fill, x_MxK, dy_MxN)


def _tgmm_ws_kernel(x_MxK, dy_MxN, group_sizes_G, fill, *, out_dtype, cfg: TileConfig,
                    plan: Plan, bad):
  """`_tgmm_kernel`'s dw[g] = x_gᵀ · dy_g, warp-specialized (TileConfig.compute_wgs == 2).

  Work items are (group, K tile of block_m, N tile of 2·block_n). Warpgroup 2 issues the TMA
  loads of each group's rows (x's bk × bm block and dy's bk × 2·bn block a step); warpgroups 0 and
  1 each own a bm × bn accumulator, one half of the dy block, and store their half of the output
  tile in chunks of `_epi_rows`. A group's first and last blocks hold rows of its neighbours:
  both consumers zero those rows of the x block (the same values, so the order of their writes
  does not matter) and each its own half of the dy block, before the product reads them. Groups
  have different row counts, so each item runs its own pipeline (no chain); an empty group's
  items store zeros (+ the fill).
  """
  plgpu = _plgpu()
  from jax.experimental import pallas as pl
  m, k = x_MxK.shape
  n = dy_MxN.shape[1]
  g = group_sizes_G.shape[0]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid_m, grid_n = k // bm, n // (2 * bn)
  band = cfg.grid_block_n if grid_n % cfg.grid_block_n == 0 else 1
  blocks = _group_blocks(group_sizes_G, bad, bk)
  out_bytes = jnp.dtype(out_dtype).itemsize
  epi = _epi_rows(cfg, out_bytes)
  transforms = _operand_transforms(x_MxK.dtype)

  def pipeline(mma, context, nblk, mi, ni):
    return plgpu.emit_pipeline_warp_specialized(
        mma, grid=(nblk,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((bk, bm), lambda i: (i, mi), transforms=transforms),
                  plgpu.BlockSpec((bk, 2 * bn), lambda i: (i, ni), transforms=transforms)],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=context)

  def body(start_ref, end_ref, first_ref, nblk_ref, fill_ref, x_gmem, dy_gmem, o_gmem):
    one = jnp.int32(1)    # the allocations depend on the blocks' shapes only
    allocs = pipeline(None, None, one, jnp.int32(0), jnp.int32(0)).get_allocations(
        x_gmem, dy_gmem)
    # Interpret mode cannot read a transposed block in wgmma (`_wgmma`): there each consumer
    # stages its transposed x block here (a scoped allocation must span the threads).
    staged = plgpu.SMEM((2, bm, bk), x_MxK.dtype) if plan.interpret else None

    @functools.partial(pl.run_scoped, pipeline_allocs=allocs,
                       o_smem=plgpu.SMEM((2, epi, bn), out_dtype), t_smem=staged,
                       collective_axes="wg")
    def _(pipeline_allocs, o_smem, t_smem):
      wg = lax.axis_index("wg")

      def store(acc, gi, row0, col0):
        """Consumer `wg`'s half tile to o_gmem[gi, row0 :, col0 :], a chunk of rows at a time."""
        for c in range(bm // epi):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last chunk's copy read it
          o_smem[wg] = acc[c * epi:(c + 1) * epi].astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              o_smem.at[wg], o_gmem.at[gi, pl.ds(row0 + c * epi, epi), pl.ds(col0, bn)])

      @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
      def _(info):
        gi = info.index[0]
        mi, ni = _snake(info.index[1], grid_m, grid_n, band)
        nblk, lo, last, rows = _group_rows(start_ref, end_ref, first_ref, nblk_ref, gi, bk, m)
        row0, col0 = mi * bm, ni * (2 * bn) + wg * bn

        def mask(x_smem, dy_smem, keep):
          _keep_rows(x_smem, keep, plan.interpret)
          for h in range(2):   # each consumer its own half, sliced statically
            pl.when(wg == h)(lambda: _keep_rows(dy_smem.at[:, pl.ds(h * bn, bn)], keep,
                                                plan.interpret))

        def mma(idx, x_smem, dy_smem, acc_ref):
          i = idx[0]
          dy_half = dy_smem.at[:, pl.ds(wg * bn, bn)]
          pl.when(i == 0)(lambda: mask(x_smem, dy_smem, lambda r: r >= lo))
          pl.when(i == nblk - 1)(lambda: mask(x_smem, dy_smem, lambda r: r <= last))

          if plan.interpret:
            t_smem[wg] = x_smem[...].T
            plgpu.wgmma(acc_ref, t_smem.at[wg], dy_half)
          else:
            plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_half)
          plgpu.wgmma_wait(0)
          return acc_ref

        def context(run):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
          def _(acc_ref):
            run(acc_ref)
            store(acc_ref[...] + fill_ref[0], gi, row0, col0)

        @pl.when(nblk > 0)
        def _():
          pipeline(mma, context, nblk, mi, ni)(x_gmem.at[rows, :], dy_gmem.at[rows, :],
                                              allocations=pipeline_allocs)

        @pl.when((nblk == 0) & (wg < 2))
        def _():   # an empty group: zeros (+ the fill: NaN for bad group sizes)
          acc = pl.run_scoped(lambda acc_ref: acc_ref[...], plgpu.ACC((bm, bn), jnp.float32))
          store(acc + fill_ref[0], gi, row0, col0)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kwargs = _kernel_kwargs(plan)
  call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype), num_threads=3,
                      thread_name="wg", **kwargs)
  return call(*blocks, fill, x_MxK, dy_MxN)


def warp_specialized(cfg: TileConfig, n: int) -> bool:
  """Whether a product with `n` output columns runs its warp-specialized kernel (`_gmm_ws_kernel`,
  `_tgmm_ws_kernel`): its config asks for two consumers and n is a multiple of their 2·block_n
  tile; otherwise the single-warpgroup kernel runs with the same blocks (n a multiple of block_n,
  as `unsupported_reason` requires)."""
  return cfg.compute_wgs == 2 and n % (2 * cfg.block_n) == 0


def _row_tile_product(x_MxK, w, group_sizes_G, *, transpose_w: bool, out_dtype, cfg: TileConfig,
                      plan: Plan):
  """The forward (w [G, K, N]) or input-gradient (w [G, N, K], transposed) product by row tiles,
  with the kernel `cfg.compute_wgs` names."""
  g = group_sizes_G.shape[0]
  bad = _bad_sizes(group_sizes_G, x_MxK.shape[0])
  tiles = _row_tiles(group_sizes_G, x_MxK.shape[0], cfg.block_m, bad)
  if warp_specialized(cfg, w.shape[1] if transpose_w else w.shape[2]):
    n_gemm = jnp.sum(tiles[0] < g).astype(jnp.int32).reshape(1)
    return _gmm_ws_kernel(x_MxK, w, tiles, n_gemm, _fill(bad), transpose_w=transpose_w,
                          out_dtype=out_dtype, cfg=cfg, plan=plan)
  return _gmm_kernel(x_MxK, w, tiles, _fill(bad), transpose_w=transpose_w, out_dtype=out_dtype,
                     cfg=cfg, plan=plan)


def _mgpu_forward(x_MxK, w_GxKxN, group_sizes_G, plan: Plan, out_dtype=_F32):
  cfg = plan.forward if jnp.dtype(out_dtype) == _F32 else plan.forward_narrow
  return _row_tile_product(x_MxK, w_GxKxN, group_sizes_G, transpose_w=False, out_dtype=out_dtype,
                           cfg=cfg, plan=plan)


def _mgpu_input_grad(dy_MxN, w_GxKxN, group_sizes_G, plan: Plan):
  return _row_tile_product(dy_MxN, w_GxKxN, group_sizes_G, transpose_w=True,
                           out_dtype=dy_MxN.dtype, cfg=plan.input_grad, plan=plan)


def _mgpu_weight_grad(x_MxK, dy_MxN, group_sizes_G, plan: Plan):
  bad = _bad_sizes(group_sizes_G, x_MxK.shape[0])
  kernel = (_tgmm_ws_kernel if warp_specialized(plan.weight_grad, dy_MxN.shape[1])
            else _tgmm_kernel)
  return kernel(x_MxK, dy_MxN, group_sizes_G, _fill(bad), out_dtype=x_MxK.dtype,
                cfg=plan.weight_grad, plan=plan, bad=bad)


def products(plan: Plan):
  """(forward, input_grad, weight_grad) of `plan.backend`, each (a, b, group_sizes) -> array (the
  forward also takes `out_dtype`: float32 or x's dtype)."""
  if plan.backend == "xla":
    return _xla_forward, _xla_input_grad, _xla_weight_grad
  if plan.backend == "mosaic_gpu":
    return (functools.partial(_mgpu_forward, plan=plan),
            functools.partial(_mgpu_input_grad, plan=plan),
            functools.partial(_mgpu_weight_grad, plan=plan))
  raise ValueError(f"grouped matmul backend {plan.backend!r} is not one of {BACKENDS}")


# --- the custom VJP -----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped_matmul(plan: Plan, out_dtype, x_MxK, w_GxKxN, group_sizes_G):
  return products(plan)[0](x_MxK, w_GxKxN, group_sizes_G, out_dtype=out_dtype)


def _grouped_matmul_fwd(plan, out_dtype, x_MxK, w_GxKxN, group_sizes_G):
  return (_grouped_matmul(plan, out_dtype, x_MxK, w_GxKxN, group_sizes_G),
          (x_MxK, w_GxKxN, group_sizes_G))


def _grouped_matmul_bwd(plan, out_dtype, res, ct_MxN):
  x_MxK, w_GxKxN, group_sizes_G = res
  _, input_grad, weight_grad = products(plan)
  dy = ct_MxN.astype(x_MxK.dtype)
  dx = input_grad(dy, w_GxKxN, group_sizes_G).astype(x_MxK.dtype)
  dw = weight_grad(x_MxK, dy, group_sizes_G).astype(w_GxKxN.dtype)
  return dx, dw, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _check_concrete_sizes(group_sizes_G, m: int):
  try:
    sizes = np.asarray(group_sizes_G)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return  # traced: a bad size makes the output NaN instead
  if (sizes < 0).any() or sizes.astype(np.int64).sum() > m:
    raise ValueError(f"group sizes must be >= 0 and sum to at most the {m} rows; got sizes with "
                     f"min {sizes.min()} and sum {sizes.astype(np.int64).sum()}")


def grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, plan: Plan = Plan(), out_dtype=jnp.float32):
  """Rows of group g of x times w[g] (module docstring); [M, N] in `out_dtype`, differentiable.

  Args:
    x_MxK: rows sorted by group.
    w_GxKxN: one [K, N] matrix per group, in x's dtype.
    group_sizes_G: int rows per group, ≥ 0, Σ ≤ M (else ValueError if concrete, NaN if traced).
    plan: backend and block sizes; a "mosaic_gpu" plan needs `unsupported_reason(...) is None`.
    out_dtype: float32 (the accumulator as it is) or x's dtype (the accumulator rounded once: half
      the output's bytes, and its cotangent arrives in x's dtype, the backward's operand dtype).
  """
  m, k = x_MxK.shape
  if w_GxKxN.ndim != 3 or w_GxKxN.shape[1] != k or group_sizes_G.shape != w_GxKxN.shape[:1]:
    raise ValueError(f"grouped_matmul shapes: x {x_MxK.shape}, w {w_GxKxN.shape}, group_sizes "
                     f"{group_sizes_G.shape} (want [M, K], [G, K, N], [G])")
  if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integers, got {group_sizes_G.dtype}")
  _check_concrete_sizes(group_sizes_G, m)
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(x_MxK.dtype)):
    raise ValueError(f"grouped_matmul out_dtype must be float32 or x's dtype {x_MxK.dtype}, "
                     f"got {out_dtype}")
  if plan.backend == "mosaic_gpu":
    reason = unsupported_reason(x_MxK, w_GxKxN, plan)
    if reason is not None:
      raise ValueError(f"grouped_matmul Mosaic GPU kernels: {reason}")
  return _grouped_matmul(plan, out_dtype, x_MxK, w_GxKxN, group_sizes_G.astype(jnp.int32))


def _op_plan() -> Plan:
  """The op's plan: the measured defaults, interpreted on the CPU."""
  return Plan(interpret=jax.default_backend() == "cpu")


def op_unsupported_reason(x_sorted_PxD, w_ExDxF, group_sizes_E, out_dtype=jnp.float32
                          ) -> str | None:
  """Why `mosaic_grouped_matmul` cannot take the op's arguments here (None: it can)."""
  return unsupported_reason(x_sorted_PxD, w_ExDxF.astype(x_sorted_PxD.dtype), _op_plan())


def mosaic_grouped_matmul(x_sorted_PxD, w_ExDxF, group_sizes_E, out_dtype=jnp.float32):
  """The op's kernel: `grouped_matmul` with w in x's dtype and the op's plan."""
  return grouped_matmul(x_sorted_PxD, w_ExDxF.astype(x_sorted_PxD.dtype), group_sizes_E,
                        _op_plan(), out_dtype)
