"""Grouped gate/up GEMM, clamped SwiGLU × routing weight in its epilogue (docs/design.md §8.2; §T7).

The kernel of the op `grouped_swiglu` (`pallas_kernels.ops.grouped_swiglu`; `mosaic_grouped_swiglu`
below): one Mosaic GPU kernel for what the routed experts otherwise run as the grouped GEMM
x · [w1 | w3] -> [a | u] followed by an XLA elementwise fusion that reads [a | u] back:

  a, u  = x[r] · w1[g(r)], x[r] · w3[g(r)]     two float32 accumulators, rounded to gate_up_dtype
  h[r]  = (g_r · SiLU(min(a, L)) · clip(u, −L, L)).astype(x.dtype)   from the rounded a and u

writing h [M, F] and [a | u] [M, 2F] (the backward's residual); rows past Σ n_g are 0 in both.
A work item is (row tile, h-column tile of `block_n` columns): the K loop pipelines x's row block
and the two [block_k, block_n] blocks of w1's and w3's same columns (w = [w1 | w3] [G, K, 2F], u's
columns at offset F) into two block_m × block_n wgmma accumulators (block_n = 64: the registers of
one 128 × 128 tile). The weights' row block [block_m] is fetched by TMA while the K loop runs. The
row tiles, the straddling group boundaries (each visit stores only its group's rows, the 2^i-row
TMA ladder) and the NaN for bad group sizes are `pallas_kernels.grouped_matmul`'s forward's.

The backward is the unfused path's math: `weighted_swiglu`'s VJP from the saved [a | u] and g
(`ops.grouped_swiglu.swiglu_cotangents`, d[a | u] rounded to its dtype once), then the gate/up
product's input and weight gradients by `grouped_matmul.products` (the d[a | u] rounded to x's
dtype first, as that product's own VJP does). Under layer remat the whole kernel runs again in
the backward (the unfused path's `moe_dispatch.GATE_UP` name has no counterpart here: with
`remat_saves=("experts",)` this path recomputes the GEMM that the other one saves).

Not measured: this file has run only in Mosaic GPU interpret mode on the CPU (the tests check it
against the op's reference and a float64 loop). Its speed, and whether the row-weight broadcast
and two accumulators lower as written, are unknown until a Hopper run
(benchmarks/gpu_runs/calls/next_s62_swiglu.sh); until then the dispatcher's "auto" runs the
unfused path (`pallas_kernels.dispatch`, op `grouped_swiglu`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import grouped_matmul as gm
from pallas_kernels.ops.grouped_swiglu import swiglu_cotangents

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static choices of one fused gate/up product: the fused forward's blocks, and the grouped GEMM
  plan of its backward products (whose `interpret` and `num_sms` the forward shares)."""
  # Not swept: block_n 64 so the two accumulators hold one 128 × 128 tile's registers; 4 stages so
  # a float32 [a | u] output (two float32 staging tiles) fits the shared memory too.
  fused: gm.TileConfig = gm.TileConfig(block_m=128, block_n=64, block_k=64, max_concurrent_steps=4,
                                       grid_block_n=2)
  products: gm.Plan = gm.Plan()


def smem_bytes(cfg: gm.TileConfig, in_bytes: int, h_bytes: int, au_bytes: int) -> int:
  """Shared memory of one program: `max_concurrent_steps` triples of operand blocks (x's bm×bk,
  w1's and w3's bk×bn), the h, a and u staging tiles and the block's bm float32 weights."""
  per_step = cfg.block_k * (cfg.block_m + 2 * cfg.block_n) * in_bytes
  return (cfg.max_concurrent_steps * per_step + cfg.block_m * cfg.block_n * (h_bytes + 2 * au_bytes)
          + cfg.block_m * 4)


def unsupported_reason(x_MxK, w_GxKxF2, gate_up_dtype=_F32, plan: Plan = Plan()) -> str | None:
  """Why the fused kernel (or its backward products) cannot take these operands here (None: it
  can): `grouped_matmul.unsupported_reason` of the gate/up product, F a multiple of the fused
  block_n, K of its block_k, [a | u] in float32 or x's dtype, and the shared memory."""
  reason = gm.unsupported_reason(x_MxK, w_GxKxF2, plan.products)
  if reason is not None:
    return reason
  cfg = plan.fused
  k, f2 = w_GxKxF2.shape[1:]
  if f2 % 2 or (f2 // 2) % cfg.block_n:
    return (f"fused: h's width {f2 / 2:g} (= [w1 | w3]'s {f2} / 2) is not a multiple of block_n "
            f"{cfg.block_n}")
  if k % cfg.block_k:
    return f"fused: contracting dim {k} is not a multiple of block_k {cfg.block_k}"
  if cfg.block_m % 64 or cfg.block_n % 64 or cfg.block_k % 64:
    return f"fused: blocks must be multiples of 64 ({cfg})"
  if cfg.max_concurrent_steps < 2:
    return "fused: max_concurrent_steps must be >= 2 (the wgmma releases its slot a step late)"
  gate_up_dtype = jnp.dtype(gate_up_dtype)
  if gate_up_dtype not in (jnp.dtype(_F32), jnp.dtype(x_MxK.dtype)):
    return f"[a | u] in {gate_up_dtype}: float32 or x's dtype {x_MxK.dtype} only"
  need = smem_bytes(cfg, 2, 2, gate_up_dtype.itemsize)
  if need > gm.SMEM_LIMIT_BYTES:
    return f"fused: {need} bytes of shared memory > {gm.SMEM_LIMIT_BYTES} ({cfg})"
  return None


def _swiglu_kernel(x_MxK, w_GxKxF2, weight_Mpad, tiles, fill, *, limit: float, gate_up_dtype,
                   cfg: gm.TileConfig, plan: gm.Plan):
  """(h [M, F] in x's dtype, [a | u] [M, 2F] in gate_up_dtype) (module docstring)."""
  plgpu = gm._plgpu()
  from jax.experimental import pallas as pl
  m, k = x_MxK.shape
  g, _, f2 = w_GxKxF2.shape
  f = f2 // 2
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid_n = f // bn
  n_tiles = tiles[0].shape[0]
  band = cfg.grid_block_n if grid_n % cfg.grid_block_n == 0 else 1
  h_dtype = x_MxK.dtype

  def body(grp_ref, blk_ref, lo_ref, hi_ref, fill_ref, x_gmem, w_gmem, g_gmem, h_gmem, au_gmem):
    @plgpu.nd_loop((n_tiles * grid_n,), collective_axes="sm")
    def _(info):
      mi, ni = gm._snake(info.index[0], n_tiles, grid_n, band)
      grp, blk, lo, hi = grp_ref[mi], blk_ref[mi], lo_ref[mi], hi_ref[mi]

      def acc_scope(a_ref, u_ref):
        def step(_, x_smem, w1_smem, w3_smem):
          plgpu.wgmma(a_ref, x_smem, w1_smem)
          plgpu.wgmma(u_ref, x_smem, w3_smem)

        @pl.when((grp < g) & (hi > lo))
        def _():
          w_g = w_gmem.at[jnp.minimum(grp, g - 1)]
          plgpu.emit_pipeline(
              step, grid=(k // bk,),
              in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (blk, kk), delay_release=1),
                        plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1),
                        plgpu.BlockSpec((bk, bn), lambda kk: (kk, grid_n + ni), delay_release=1)],
              max_concurrent_steps=cfg.max_concurrent_steps,
          )(x_gmem, w_g, w_g)
        return a_ref[...], u_ref[...]

      def weight_scope(g_smem, g_barrier):
        # the block's routing weights arrive while the K loop runs
        plgpu.copy_gmem_to_smem(g_gmem.at[pl.ds(blk * bm, bm)], g_smem, g_barrier)
        a, u = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)), plgpu.ACC((bm, bn)))
        plgpu.barrier_wait(g_barrier)
        return a, u, g_smem[...]

      a, u, g_rows = pl.run_scoped(weight_scope, plgpu.SMEM((bm,), _F32),
                                   plgpu.Barrier(num_arrivals=1))
      # [a | u] as the backward will read it, and h from those same rounded values
      a = (a + fill_ref[0]).astype(gate_up_dtype)
      u = (u + fill_ref[0]).astype(gate_up_dtype)
      a32 = jnp.minimum(a.astype(_F32), limit)
      u32 = jnp.clip(u.astype(_F32), -limit, limit)
      h = (jax.nn.silu(a32) * u32 * lax.broadcast_in_dim(g_rows, (bm, bn), (0,))).astype(h_dtype)

      @functools.partial(pl.run_scoped, h_smem=plgpu.SMEM((bm, bn), h_dtype),
                         a_smem=plgpu.SMEM((bm, bn), gate_up_dtype),
                         u_smem=plgpu.SMEM((bm, bn), gate_up_dtype))
      def _(h_smem, a_smem, u_smem):
        h_smem[...] = h
        a_smem[...] = a
        u_smem[...] = u
        plgpu.commit_smem()
        row0 = blk * bm
        gm._store_rows(h_smem, h_gmem, lo, hi, row0, ni * bn, bm, bn, m, wait=False)
        gm._store_rows(a_smem, au_gmem, lo, hi, row0, ni * bn, bm, bn, m, wait=False)
        gm._store_rows(u_smem, au_gmem, lo, hi, row0, f + ni * bn, bm, bn, m)

  out_type = (jax.ShapeDtypeStruct((m, f), h_dtype), jax.ShapeDtypeStruct((m, f2), gate_up_dtype))
  call = plgpu.kernel(body, out_type=out_type, **gm._kernel_kwargs(plan))
  return call(*tiles, fill, x_MxK, w_GxKxF2, weight_Mpad)


def _forward(x_MxK, w_GxKxF2, weight_M, group_sizes_G, *, limit, gate_up_dtype, plan: Plan):
  m = x_MxK.shape[0]
  cfg = plan.fused
  bad = gm._bad_sizes(group_sizes_G, m)
  tiles = gm._row_tiles(group_sizes_G, m, cfg.block_m, bad)
  # whole row blocks of weights, so that the last block's TMA read stays inside the array
  weight = jnp.pad(weight_M.astype(_F32), (0, -(-m // cfg.block_m) * cfg.block_m - m))
  return _swiglu_kernel(x_MxK, w_GxKxF2, weight, tiles, gm._fill(bad), limit=limit,
                        gate_up_dtype=gate_up_dtype, cfg=cfg, plan=plan.products)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped_swiglu(plan: Plan, limit: float, gate_up_dtype, x_MxK, w_GxKxF2, weight_M,
                    group_sizes_G):
  return _forward(x_MxK, w_GxKxF2, weight_M, group_sizes_G, limit=limit,
                  gate_up_dtype=gate_up_dtype, plan=plan)


def _grouped_swiglu_fwd(plan, limit, gate_up_dtype, x_MxK, w_GxKxF2, weight_M, group_sizes_G):
  h, au = _grouped_swiglu(plan, limit, gate_up_dtype, x_MxK, w_GxKxF2, weight_M, group_sizes_G)
  return (h, au), (x_MxK, w_GxKxF2, weight_M, group_sizes_G, au)


def _grouped_swiglu_bwd(plan, limit, gate_up_dtype, res, cts):
  x_MxK, w_GxKxF2, weight_M, group_sizes_G, au = res
  dh, ct_au = cts
  d_au, d_weight = swiglu_cotangents(au, weight_M.astype(_F32), dh, limit)
  # `weighted_swiglu`'s rounding to au's dtype (with au's own cotangent, zero unless a caller
  # reads au), then the gate/up product's backward as `grouped_matmul`'s VJP runs it
  dy = (d_au + ct_au.astype(_F32)).astype(au.dtype).astype(x_MxK.dtype)
  _, input_grad, weight_grad = gm.products(plan.products)
  dx = input_grad(dy, w_GxKxF2, group_sizes_G).astype(x_MxK.dtype)
  dw = weight_grad(x_MxK, dy, group_sizes_G).astype(w_GxKxF2.dtype)
  return dx, dw, d_weight.astype(weight_M.dtype), None


_grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)


def grouped_swiglu(x_MxK, w_GxKxF2, weight_M, group_sizes_G, plan: Plan = Plan(), *,
                   limit: float, gate_up_dtype=_F32):
  """(h [M, F] in x's dtype, [a | u] [M, 2F] in `gate_up_dtype`) (module docstring),
  differentiable in x, w and weight.

  Args:
    x_MxK: rows sorted by group, bf16 or f16.
    w_GxKxF2: [w1 | w3] per group, [G, K, 2F] in x's dtype (u's columns at offset F).
    weight_M: each row's routing weight, float32.
    group_sizes_G: int rows per group, ≥ 0, Σ ≤ M (else ValueError if concrete, NaN if traced).
    plan: the fused forward's blocks and the backward products' plan; needs
      `unsupported_reason(...) is None`.
    limit: the SwiGLU clamp.
    gate_up_dtype: [a | u]'s dtype, float32 or x's dtype; h is computed from those rounded values.
  """
  m, k = x_MxK.shape
  if (w_GxKxF2.ndim != 3 or w_GxKxF2.shape[1] != k or group_sizes_G.shape != w_GxKxF2.shape[:1]
      or weight_M.shape != (m,)):
    raise ValueError(f"grouped_swiglu shapes: x {x_MxK.shape}, w {w_GxKxF2.shape}, weight "
                     f"{weight_M.shape}, group_sizes {group_sizes_G.shape} (want [M, K], "
                     "[G, K, 2F], [M], [G])")
  if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integers, got {group_sizes_G.dtype}")
  gm._check_concrete_sizes(group_sizes_G, m)
  reason = unsupported_reason(x_MxK, w_GxKxF2, gate_up_dtype, plan)
  if reason is not None:
    raise ValueError(f"grouped_swiglu Mosaic GPU kernel: {reason}")
  return _grouped_swiglu(plan, float(limit), jnp.dtype(gate_up_dtype), x_MxK, w_GxKxF2, weight_M,
                         group_sizes_G.astype(jnp.int32))


def _op_plan() -> Plan:
  """The op's plan: the defaults, interpreted on the CPU."""
  return Plan(products=gm._op_plan())


def op_unsupported_reason(x_sorted_PxD, w13_ExDxF2, weight_P, group_sizes_E, *, limit: float,
                          gate_up_dtype=_F32) -> str | None:
  """Why `mosaic_grouped_swiglu` cannot take the op's arguments here (None: it can)."""
  return unsupported_reason(x_sorted_PxD, w13_ExDxF2.astype(x_sorted_PxD.dtype), gate_up_dtype,
                            _op_plan())


def mosaic_grouped_swiglu(x_sorted_PxD, w13_ExDxF2, weight_P, group_sizes_E, *, limit: float,
                          gate_up_dtype=_F32):
  """The op's kernel: `grouped_swiglu` with w in x's dtype and the op's plan."""
  return grouped_swiglu(x_sorted_PxD, w13_ExDxF2.astype(x_sorted_PxD.dtype), weight_P,
                        group_sizes_E, _op_plan(), limit=limit, gate_up_dtype=gate_up_dtype)
