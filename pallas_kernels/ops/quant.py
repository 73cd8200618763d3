"""Op: low-precision formats and straight-through fake quantization (docs/design.md §9).

Every quantizer here is a pure quantize -> dequantize function of a float array: the result has
the input's dtype and holds exactly the values the low-precision format can represent after
scaling. Block amaxes and scales are computed in float32 (§9.4). Both grids (E2M1, E4M3) are
reached arithmetically, never by a float4/float8 cast: inside a kernel a float4 cast fails on
Hopper (docs/design.md §T5), and under `jit` on GPU XLA drops a f32 -> f8 -> f32 round trip
altogether (excess precision). The tests check every function bit for bit against the
`ml_dtypes` casts with the spec's scales, eagerly and under `jit`.

Formats (block = contiguous elements of the LAST axis sharing one scale):

| function        | §     | block | scale                                   | element |
|-----------------|-------|-------|-----------------------------------------|---------|
| `fp4_main_kv`   | 9.2   | 16    | E4M3(max(amax, 6·2^-9) / 6)             | E2M1    |
| `mxfp4`         | 9.2   | 32    | 2^ceil(log2(max(amax, 6·2^-126) / 6))   | E2M1    |
| `fp8_swa`       | 9.2   | 32    | 2^ceil(log2(max(amax, 1e-4) / 448))     | E4M3    |

The three straight-through fake quantizers are ops of the dispatcher (`pallas_kernels.dispatch`:
`fake_quant_fp4_main_kv`, `fake_quant_mxfp4`, `fake_quant_fp8_swa`, each with a fused kernel in
`pallas_kernels/fake_quant.py`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Smallest positive E4M3 value (a subnormal): the main-KV scale never drops below it.
E4M3_MIN_SUBNORMAL = 2.0 ** -9

FP4_MAIN_KV_BLOCK = 16
MXFP4_BLOCK = 32
FP8_SWA_BLOCK = 32
# Lower bounds of the block amax in the power-of-two formats (§9.2).
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0 ** -126
FP8_AMAX_FLOOR = 1e-4


# --- element grids -------------------------------------------------------------------------


def round_to_e2m1(x: jax.Array) -> jax.Array:
  """Round to the nearest E2M1 value {0, ±.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, ties to the even code.

  |x| is saturated at 6. Within each binade the grid is uniform (step .5 below 2, 1 in [2, 4),
  2 in [4, 6]), so RNE on |x| / step picks the even code on ties: 0.25, 1.25, 2.5 and 5 go down,
  0.75, 1.75 and 3.5 go up (§9.1). The sign is kept (−0 stays −0, like the float4 cast).
  """
  a = jnp.minimum(jnp.abs(x), jnp.asarray(E2M1_MAX, x.dtype))
  step = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0)).astype(x.dtype)
  return jnp.copysign(jnp.round(a / step) * step, x)


def _pow2(biased_exponent: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(biased_exponent << 23, jnp.float32)


def round_to_e4m3(x: jax.Array) -> jax.Array:
  """Round float32 |x| ≤ 448 to the nearest E4M3 value (RNE, subnormals included), sign kept.

  Integer arithmetic on the float32 bits instead of `astype(float8_e4m3fn).astype(float32)`:
  XLA on GPU drops such a round trip inside `jit` (excess precision is allowed by default), so
  the cast would not round at all. x = m·2^(e−23) with the 24-bit significand m; E4M3 keeps 3
  mantissa bits down to exponent −6 and the fixed spacing 2^-9 below, so k = 20 + max(0, −6 − e)
  low bits of m are dropped with round-half-to-even (k ≤ 25 suffices: smaller values round to 0).
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  biased = (bits >> 23) & 0xFF
  m = (bits & 0x7FFFFF) | 0x800000
  k = 20 + jnp.clip((127 - 6) - biased, 0, 5)
  q = m >> k
  rem = m & ((1 << k) - 1)
  half = 1 << (k - 1)
  q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
  return jnp.copysign(q.astype(jnp.float32) * _pow2(biased - 23 + k), x)


def _ceil_pow2(y_f32: jax.Array) -> jax.Array:
  """2^ceil(log2 y) for positive normal float32 y, exactly (read from the bits, no log)."""
  bits = jax.lax.bitcast_convert_type(y_f32, jnp.int32)
  exponent = (bits >> 23) & 0xFF  # biased
  exponent = exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
  return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def div_short(x: jax.Array, s: jax.Array) -> jax.Array:
  """x / s correctly rounded (float32), for positive divisors s with at most 4 significant bits.

  Needed because XLA rewrites `x / broadcast(s)` and `x / constant` into `x * (1/s)`, which is
  not the correctly rounded quotient and flips E2M1 ties under `jit`. The rough quotient
  q0 = x·(1/s) is corrected by its exact residual ρ = x − q0·s: q0 is split into a 20-bit head
  and a 4-bit tail, so head·s and tail·s are exact and so are both subtractions (Sterbenz), and
  q0 + ρ·(1/s) rounds to RN(x/s). No quotient x/s is exactly halfway between two floats (x would
  need more than 24 bits), and it stays ≥ ulp/32 from such a midpoint, far beyond the error of
  ρ·(1/s), so the result does not depend on how 1/s itself was rounded.
  """
  r = 1.0 / s
  q0 = x * r
  head = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(q0, jnp.int32) & ~0xF, jnp.float32)
  rho = (x - head * s) - (q0 - head) * s
  return jnp.copysign(q0 + rho * r, x)  # s > 0: keeps the sign of x, and of ±0


def pow2_scale(amax: jax.Array, element_max: float, floor: float) -> jax.Array:
  """2^ceil(log2(max(amax, floor) / element_max)) in float32: the power-of-two block scale of
  `mxfp4` (E2M1, floor `MXFP4_AMAX_FLOOR`) and `fp8_swa` (E4M3, floor `FP8_AMAX_FLOOR`). It rounds
  up, so |x / scale| <= element_max and nothing clips. `launch.weight_formats` stores weights with
  the same rule."""
  return _ceil_pow2(jnp.maximum(amax.astype(jnp.float32), floor) / element_max)


def _blocks(x: jax.Array, block: int) -> jax.Array:
  if x.shape[-1] % block:
    raise ValueError(f"last axis ({x.shape[-1]}) is not a multiple of the block size {block}")
  return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _block_amax(xb: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(xb), axis=-1, keepdims=True)


# --- block formats -------------------------------------------------------------------------


def fp4_main_kv_scale(amax: jax.Array) -> jax.Array:
  """E4M3(max(amax, 6·2^-9) / 6) in float32, saturating at 448 (amax beyond 2688 is clipped)."""
  s = div_short(jnp.maximum(amax, E2M1_MAX * E4M3_MIN_SUBNORMAL), jnp.float32(E2M1_MAX))
  return round_to_e4m3(jnp.minimum(s, E4M3_MAX))


def fp4_main_kv(x: jax.Array) -> jax.Array:
  """V4.1 main-KV cache format, "NVFP4 without the global scale" (§9.2), quantize->dequantize.

  Blocks of 16 along the last axis; scale = E4M3(max(amax, 6·2^-9)/6); q = RNE_E2M1(clip(x/scale,
  −6, 6)); returns q·scale in x's dtype. The E4M3 scale is rounded to nearest, so the block
  maximum can exceed 6·scale and is then clipped. Both divisions are correctly rounded
  (`div_short`) also under `jit`.
  """
  xb = _blocks(x, FP4_MAIN_KV_BLOCK)
  scale = fp4_main_kv_scale(_block_amax(xb))
  q = round_to_e2m1(jnp.clip(div_short(xb, scale), -E2M1_MAX, E2M1_MAX))
  return (q * scale).reshape(x.shape).astype(x.dtype)


def mxfp4(x: jax.Array) -> jax.Array:
  """MXFP4, DeepSeek's variant (§9.2): blocks of 32, scale 2^ceil(log2(amax/6)), E2M1 elements.

  amax is clamped at ≥ 6·2^-126; the scale rounds up, so |x/scale| ≤ 6 and nothing clips.
  """
  xb = _blocks(x, MXFP4_BLOCK)
  scale = pow2_scale(_block_amax(xb), E2M1_MAX, MXFP4_AMAX_FLOOR)
  q = round_to_e2m1(jnp.clip(xb / scale, -E2M1_MAX, E2M1_MAX))
  return (q * scale).reshape(x.shape).astype(x.dtype)


def fp8_swa(x: jax.Array) -> jax.Array:
  """SWA KV format (§9.2): blocks of 32, scale 2^ceil(log2(amax/448)) (amax ≥ 1e-4), E4M3 elements."""
  xb = _blocks(x, FP8_SWA_BLOCK)
  scale = pow2_scale(_block_amax(xb), E4M3_MAX, FP8_AMAX_FLOOR)
  q = round_to_e4m3(jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX))
  return (q * scale).reshape(x.shape).astype(x.dtype)


# --- straight-through estimator ------------------------------------------------------------


def fake_quant(x: jax.Array, fq: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """Forward fq(x) exactly, gradient identity (straight-through, §9.4; no clip mask).

  Equivalent to `x + stop_gradient(fq(x) - x)`, except that the forward value is fq(x) bit for
  bit (the add/subtract form can round in bfloat16).
  """
  return _straight_through(x, fq(x))


@jax.custom_vjp
def _straight_through(x: jax.Array, y: jax.Array) -> jax.Array:
  del x
  return y


def _straight_through_fwd(x, y):
  del x
  return y, None


def _straight_through_bwd(_, g):
  return g, None


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def fake_quant_fp4_main_kv(x: jax.Array) -> jax.Array:
  """Straight-through FP4 main-KV fake quantization (§9.2): the op's reference."""
  return fake_quant(x, fp4_main_kv)


def fake_quant_mxfp4(x: jax.Array) -> jax.Array:
  """Straight-through MXFP4 fake quantization (indexer q and k, §9.2): the op's reference."""
  return fake_quant(x, mxfp4)


def fake_quant_fp8_swa(x: jax.Array) -> jax.Array:
  """Straight-through FP8 SWA-KV fake quantization (§9.2): the op's reference."""
  return fake_quant(x, fp8_swa)
