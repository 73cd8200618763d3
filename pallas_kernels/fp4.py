"""Fused FP4 main-KV fake quantization (MODEL.md §9.2 "V4.1 main-KV cache", §9.4; TRAINING.md §5).

One pass over the data: each program loads `block_rows` blocks of 16 values, computes the block
amax, the E4M3 scale and the E2M1 codes in registers, and writes q·scale. The math restates
`dsv41_jax.quant.fp4_main_kv` (the tests hold the two bit for bit equal):

  scale = E4M3(min(max(amax, 6·2^-9) / 6, 448))    (saturating; the model's reference does the same)
  deq   = RNE_E2M1(clip(x / scale, −6, 6)) · scale

No float8/float4 casts inside the kernel (a float4 cast fails on Hopper, TRAINING.md §5): the E4M3
scale is rounded from its float32 bits, the E2M1 grid by thresholds whose ties follow §9.1, and the
divisions are made correctly rounded by hand (`div_rn`: Triton's float32 division is approximate).
Backend: Triton through `pl.pallas_call` with explicit `CompilerParams` (block shapes are powers of
two); `interpret=True` runs the same kernel on CPU. The VJP is the straight-through identity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

BLOCK = 16
_F32_SIGN = np.int32(-2 ** 31)


def _triton_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def e2m1_magnitude(a: jax.Array) -> jax.Array:
  """E2M1 value nearest to a ∈ [0, 6] (ties to the even code, §9.1) by threshold sums.

  Ties 0.25, 1.25, 2.5, 5 stay below (strict >); ties 0.75, 1.75, 3.5 step up (>=).
  """
  def step(cond, size):
    return jnp.where(cond, jnp.float32(size), jnp.float32(0.0))
  return (step(a > 0.25, 0.5) + step(a >= 0.75, 0.5) + step(a > 1.25, 0.5) + step(a >= 1.75, 0.5)
          + step(a > 2.5, 1.0) + step(a >= 3.5, 1.0) + step(a > 5.0, 2.0))


def _pow2(biased_exponent: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(biased_exponent << 23, jnp.float32)


def e4m3_round_positive(s: jax.Array) -> jax.Array:
  """Round float32 s ∈ [2^-9, 448] to the nearest E4M3 value (RNE), in integer arithmetic.

  s = m · 2^(e−23) with the 24-bit significand m. E4M3 keeps 3 mantissa bits and has a smallest
  normal exponent of −6, so k = 20 + max(0, −6 − e) low bits of m are dropped with
  round-half-to-even, and the kept integer is scaled by 2^(e−23+k) (≥ 2^-9, exact). Integer ops
  only: a float `(v + 2^23) − 2^23` trick would be folded away by XLA.
  """
  bits = jax.lax.bitcast_convert_type(s, jnp.int32)
  biased = (bits >> 23) & 0xFF
  m = (bits & 0x7FFFFF) | 0x800000
  k = 20 + jnp.maximum(0, (127 - 6) - biased)
  q = m >> k
  rem = m & ((1 << k) - 1)
  half = 1 << (k - 1)
  q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
  return q.astype(jnp.float32) * _pow2(biased - 23 + k)


def div_rn(x: jax.Array, s: jax.Array) -> jax.Array:
  """x / s rounded to nearest for divisors s with at most 4 significant bits (E4M3 values, 6).

  Triton lowers float32 `/` to the approximate `div.full.f32`, which flips E2M1 decisions near
  the thresholds. Here a rough quotient q0 = x · (1/s) is corrected with its exact residual
  ρ = x − q0·s (q0 split into a 20-bit head and a 4-bit tail, so both products with the 4-bit s
  are exact and the subtraction is exact by Sterbenz): q0 + ρ·(1/s) then rounds to RN(x/s). x/s
  is never exactly halfway between two floats (that would need x to carry more than 24 bits), and
  it stays ≥ ulp/32 away from such a midpoint, far beyond the error of ρ·(1/s).
  """
  r = 1.0 / s
  q0 = x * r
  head = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(q0, jnp.int32) & ~0xF,
                                      jnp.float32)
  tail = q0 - head
  rho = (x - head * s) - tail * s
  return q0 + rho * r


def _fp4_kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)  # [block_rows, 16]
  amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  s = jnp.minimum(div_rn(jnp.maximum(amax, 6.0 * 2.0 ** -9), jnp.float32(6.0)), 448.0)
  scale = e4m3_round_positive(s)
  v = jnp.clip(div_rn(x, scale), -6.0, 6.0)
  q = e2m1_magnitude(jnp.abs(v))
  sign = jax.lax.bitcast_convert_type(x, jnp.int32) & _F32_SIGN  # sign(v) = sign(x), ±0 kept
  q = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(q, jnp.int32) | sign, jnp.float32)
  o_ref[...] = (q * scale).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret", "num_warps"))
def fp4_main_kv_pallas(x: jax.Array, *, block_rows: int = 1024, interpret: bool = False,
                       num_warps: int = 8) -> jax.Array:
  """Quantize->dequantize x (last axis a multiple of 16) in the main-KV FP4 format; x's dtype."""
  if x.shape[-1] % BLOCK:
    raise ValueError(f"last axis ({x.shape[-1]}) is not a multiple of the block size {BLOCK}")
  if block_rows & (block_rows - 1):
    raise ValueError(f"block_rows ({block_rows}) must be a power of two")
  rows = x.size // BLOCK
  x2 = x.reshape(rows, BLOCK)
  padded = pl.cdiv(rows, block_rows) * block_rows
  if padded != rows:
    x2 = jnp.pad(x2, ((0, padded - rows), (0, 0)))
  out = pl.pallas_call(
      _fp4_kernel,
      out_shape=jax.ShapeDtypeStruct(x2.shape, x.dtype),
      grid=(padded // block_rows,),
      in_specs=[pl.BlockSpec((block_rows, BLOCK), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((block_rows, BLOCK), lambda i: (i, 0)),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages=1),
      interpret=interpret,
      name="fp4_main_kv",
  )(x2)
  return out[:rows].reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant(x, interpret):
  return fp4_main_kv_pallas(x, interpret=interpret)


def _fake_quant_fwd(x, interpret):
  return fp4_main_kv_pallas(x, interpret=interpret), None


def _fake_quant_bwd(interpret, _, g):
  del interpret
  return (g,)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fp4_main_kv_fake_quant(x: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """Forward: the fused FP4 main-KV quantize->dequantize; gradient: identity (straight-through).

  `interpret=None` interprets on CPU and compiles (Triton) on GPU.
  """
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return _fake_quant(x, interpret)
