"""Fused block fake quantization: FP4 main-KV, MXFP4, FP8 SWA (docs/design.md §9.2, §9.4; §T5).

One pass over the data, straight-through gradient. Each program loads `block_rows` blocks (rows of
16 or 32 values sharing one scale), computes the block amax and scale in registers and writes the
dequantized values in x's dtype. The math restates the op `pallas_kernels.ops.quant.{fp4_main_kv,
mxfp4, fp8_swa}` in a kernel's form and the tests hold kernel and reference bit for bit equal.

Why the element path looks the way it does: a bf16 fake quant moves 4 bytes per element, so at the
H200's 4.3 TB/s copy rate a kernel has ~35 float32 instructions per element before it stops being
memory bound (132 SMs × 128 lanes × ~1.9 GHz / 1.1e12 elements/s), and integer ops run at half
rate. The first main-KV kernel spent ~40 (two corrected divisions, threshold sums, bit
fiddling) and ran at 23–35 % of the copy rate. Here the per-element work is ~15 instructions:

- main KV (scale s = E4M3, up to 4 significant bits): no division per element. RN(x/s) lies on
  the same side of each E2M1 tie point t as x/s itself (x/s ≠ t is more than half an ulp of t
  away from t, because s has ≤ 4 significant bits), and t·s is exact, so the E2M1 level is picked
  by comparing |x| with the seven products t·s (strict for the ties that round down, ≥ for those
  that round up, §9.1) in a chain of selects, each yielding the exact product q·s.
- MXFP4 / FP8 (power-of-two scale): y = x·(1/s) is exact; y is rounded to its format by the
  magic-number add (y + C) − C with C = 2^(max(e_y, e_min) + 23 − m), which makes the float
  adder round y to m mantissa bits (ties to even) in its binade, and to the subnormal step below
  2^e_min. C depends on the data, so no compiler can fold the add and subtract away.

No float8/float4 casts in the kernels (a float4 cast fails on Hopper; docs/design.md §T5). Backend:
Triton via `pl.pallas_call` with explicit `CompilerParams` (power-of-two blocks); `interpret=True`
runs the same kernels on CPU. Row counts the block cannot tile are padded (logged once). The
straight-through wrappers are the kernels of the dispatcher's `fake_quant_*` ops, which run them
per batch shard under a mesh (`pallas_kernels.dispatch`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.notices import log_once

_F32_SIGN = np.int32(-2 ** 31)
_F32_EXP = np.int32(0x7F800000)
BLOCK = {"fp4_main_kv": 16, "mxfp4": 32, "fp8_swa": 32}
# (tie point t, strict ">" for ties that round down, level q) for E2M1 on [0, 6] (§9.1).
_E2M1_STEPS = ((0.25, True, 0.5), (0.75, False, 1.0), (1.25, True, 1.5), (1.75, False, 2.0),
               (2.5, True, 3.0), (3.5, False, 4.0), (5.0, True, 6.0))

def _triton_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _bits(v):
  return jax.lax.bitcast_convert_type(v, jnp.int32)


def _f32(b):
  return jax.lax.bitcast_convert_type(b, jnp.float32)


def e2m1_magnitude(a: jax.Array) -> jax.Array:
  """E2M1 value nearest to a ∈ [0, 6] (ties to the even code, §9.1) by threshold sums."""
  out = jnp.zeros_like(a)
  for t, strict, q in _E2M1_STEPS:
    out = jnp.where(a > t if strict else a >= t, jnp.float32(q), out)
  return out


def e4m3_round_positive(s: jax.Array) -> jax.Array:
  """Round float32 s ∈ [2^-9, 448] to the nearest E4M3 value (RNE), in integer arithmetic.

  s = m · 2^(e−23) with the 24-bit significand m; k = 20 + max(0, −6 − e) low bits of m are
  dropped with round-half-to-even and the kept integer is scaled by 2^(e−23+k) (≥ 2^-9, exact).
  """
  bits = _bits(s)
  biased = (bits >> 23) & 0xFF
  m = (bits & 0x7FFFFF) | 0x800000
  k = 20 + jnp.maximum(0, (127 - 6) - biased)
  q = m >> k
  rem = m & ((1 << k) - 1)
  half = 1 << (k - 1)
  q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
  return q.astype(jnp.float32) * _f32((biased - 23 + k) << 23)


def div_rn(x: jax.Array, s: jax.Array) -> jax.Array:
  """x / s rounded to nearest for divisors s with at most 4 significant bits (E4M3 values, 6, 448).

  Triton lowers float32 `/` to the approximate `div.full.f32`. A rough quotient q0 = x·(1/s) is
  corrected with its exact residual ρ = x − q0·s (q0 split into a 20-bit head and a 4-bit tail,
  so both products with the 4-bit s are exact, and so is the subtraction); q0 + ρ·(1/s) then
  rounds to RN(x/s), since x/s stays ≥ ulp/32 away from any midpoint between two floats.
  """
  r = 1.0 / s
  q0 = x * r
  head = _f32(_bits(q0) & ~0xF)
  tail = q0 - head
  rho = (x - head * s) - tail * s
  return q0 + rho * r


def _ceil_pow2(y):
  """2^ceil(log2 y) for positive normal float32 y, read from the bits."""
  bits = _bits(y)
  e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
  return _f32(e << 23)


def _round_mantissa(a, mantissa_bits: int, e_min: int):
  """a ≥ 0 rounded to `mantissa_bits` bits in its binade, to steps of 2^(e_min − mantissa_bits)
  below 2^e_min (the subnormals), ties to even: the magic-number add (a + C) − C."""
  e = jnp.maximum(_bits(a) & _F32_EXP, np.int32((127 + e_min) << 23))
  c = _f32(e + np.int32((23 - mantissa_bits) << 23))
  return (a + c) - c


def _with_sign_of(mag, x):
  return _f32(_bits(mag) | (_bits(x) & _F32_SIGN))  # sign(x), ±0 kept


def _fp4_main_kv_block(x):
  """x [rows, 16] float32 -> dequantized values (see module doc)."""
  a = jnp.abs(x)
  amax = jnp.max(a, axis=1, keepdims=True)
  s = e4m3_round_positive(jnp.minimum(div_rn(jnp.maximum(amax, 6.0 * 2.0 ** -9),
                                             jnp.float32(6.0)), 448.0))
  mag = jnp.zeros_like(a)
  for t, strict, q in _E2M1_STEPS:  # t·s and q·s are exact (≤ 3 and ≤ 4 significant bits)
    ts = s * t
    mag = jnp.where(a > ts if strict else a >= ts, s * q, mag)
  return _with_sign_of(mag, x)


def _pow2_scaled_block(x, *, amax_floor: float, grid_max: float, mantissa_bits: int,
                       e_min: int):
  """MXFP4 / FP8: scale = 2^ceil(log2(max(amax, floor) / grid_max)), element on the grid."""
  amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), amax_floor)
  scale = _ceil_pow2(div_rn(amax, jnp.float32(grid_max)))
  inv = _f32(np.int32(254 << 23) - _bits(scale))  # 1 / scale, exact (scale ∈ [2^-126, 2^126])
  a = jnp.minimum(jnp.abs(x) * inv, grid_max)
  return _with_sign_of(_round_mantissa(a, mantissa_bits, e_min), x) * scale


_BLOCK_FN = {
    "fp4_main_kv": _fp4_main_kv_block,
    "mxfp4": functools.partial(_pow2_scaled_block, amax_floor=6.0 * 2.0 ** -126, grid_max=6.0,
                               mantissa_bits=1, e_min=0),
    "fp8_swa": functools.partial(_pow2_scaled_block, amax_floor=1e-4, grid_max=448.0,
                                 mantissa_bits=3, e_min=-6),
}


def _kernel(x_ref, o_ref, *, fmt: str):
  o_ref[...] = _BLOCK_FN[fmt](x_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "block_rows", "interpret", "num_warps"))
def fake_quant_pallas(x: jax.Array, *, fmt: str, block_rows: int = 1024, interpret: bool = False,
                      num_warps: int = 8) -> jax.Array:
  """Quantize->dequantize x (last axis a multiple of the format's block) in `fmt`; x's dtype.

  fmt: "fp4_main_kv" (block 16), "mxfp4" (32) or "fp8_swa" (32). The block count is tiled by
  `block_rows` (a power of two, lowered to the largest power of two dividing the count when one
  ≥ 64 does; otherwise the rows are padded, logged once per shape).
  """
  block = BLOCK[fmt]
  if x.shape[-1] % block:
    raise ValueError(f"last axis ({x.shape[-1]}) is not a multiple of the block size {block}")
  if block_rows & (block_rows - 1):
    raise ValueError(f"block_rows ({block_rows}) must be a power of two")
  rows = x.size // block
  x2 = x.reshape(rows, block)
  fit = min(block_rows, rows & -rows)
  if fit >= min(64, block_rows):
    block_rows = fit
  padded = pl.cdiv(rows, block_rows) * block_rows
  if padded != rows:
    log_once((fmt, x.shape, block_rows),
              f"fake_quant_pallas[{fmt}]: {rows} blocks are not tiled by {block_rows}; "
              f"padding to {padded} (one extra copy of x)")
    x2 = jnp.pad(x2, ((0, padded - rows), (0, 0)))
  out = pl.pallas_call(
      functools.partial(_kernel, fmt=fmt),
      out_shape=jax.ShapeDtypeStruct(x2.shape, x.dtype),
      grid=(padded // block_rows,),
      in_specs=[pl.BlockSpec((block_rows, block), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((block_rows, block), lambda i: (i, 0)),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages=1),
      interpret=interpret,
      name=f"fake_quant_{fmt}",
  )(x2)
  return out[:rows].reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quant(x, fmt, interpret):
  return fake_quant_pallas(x, fmt=fmt, interpret=interpret)


def _fake_quant_fwd(x, fmt, interpret):
  return _fake_quant(x, fmt, interpret), None


def _fake_quant_bwd(fmt, interpret, _, g):
  del fmt, interpret
  return (g,)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def _resolve(interpret):
  return jax.default_backend() == "cpu" if interpret is None else interpret


def _unsupported(fmt: str, x) -> str | None:
  if x.shape[-1] % BLOCK[fmt]:
    return f"last axis {x.shape[-1]} is not a multiple of the {fmt} block {BLOCK[fmt]}"
  return None


def unsupported_fp4_main_kv(x) -> str | None:
  """Why the kernels cannot take x (None if they can); likewise the next two."""
  return _unsupported("fp4_main_kv", x)


def unsupported_mxfp4(x) -> str | None:
  return _unsupported("mxfp4", x)


def unsupported_fp8_swa(x) -> str | None:
  return _unsupported("fp8_swa", x)


def fp4_main_kv_fake_quant(x: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """Kernel of the op `fake_quant_fp4_main_kv`: fused forward, identity gradient.

  `interpret=None` interprets on CPU and compiles (Triton) on GPU; likewise below.
  """
  return _fake_quant(x, "fp4_main_kv", _resolve(interpret))


def mxfp4_fake_quant(x: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """Kernel of the op `fake_quant_mxfp4`."""
  return _fake_quant(x, "mxfp4", _resolve(interpret))


def fp8_swa_fake_quant(x: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """Kernel of the op `fake_quant_fp8_swa`."""
  return _fake_quant(x, "fp8_swa", _resolve(interpret))
