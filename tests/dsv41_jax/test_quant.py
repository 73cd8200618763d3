"""dsv41_jax/quant.py against the ml_dtypes float4/float8 casts with the spec's scales (docs/design.md §9)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels import dispatch

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn


def _bits(a) -> np.ndarray:
  return np.asarray(a, np.float32).view(np.uint32)


def _assert_bitwise(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape
  bad = _bits(got) != _bits(want)
  assert not bad.any(), f"{bad.sum()} of {bad.size} differ, e.g. got {got[bad][:5]} want {want[bad][:5]}"


def _kv_like(rng, shape, block):
  """Random values whose blocks span magnitudes 1e-5 .. 1e2 (subnormal to large E4M3 scales; the
  block amax stays below 448·6 = 2688, where the E4M3 scale would overflow)."""
  x = rng.standard_normal(shape).astype(np.float32)
  mag = 10.0 ** rng.uniform(-5, 2, size=shape[:-1] + (shape[-1] // block, 1))
  return (x.reshape(*shape[:-1], -1, block) * mag).reshape(shape).astype(np.float32)


# --- numpy references with the spec's scales ------------------------------------------------


def ref_fp4_main_kv(x):
  xb = x.reshape(*x.shape[:-1], -1, 16)
  amax = np.abs(xb).max(-1, keepdims=True)
  scale = (np.maximum(amax, np.float32(6 * 2.0 ** -9)) / np.float32(6)).astype(F8).astype(np.float32)
  q = np.clip(xb / scale, -6, 6).astype(F4).astype(np.float32)
  return (q * scale).reshape(x.shape)


def ref_mxfp4(x):
  xb = x.reshape(*x.shape[:-1], -1, 32)
  amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(6 * 2.0 ** -126))
  scale = (2.0 ** np.ceil(np.log2((amax / np.float32(6)).astype(np.float64)))).astype(np.float32)
  q = (xb / scale).astype(F4).astype(np.float32)
  return (q * scale).reshape(x.shape)


def ref_fp8_swa(x):
  xb = x.reshape(*x.shape[:-1], -1, 32)
  amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(1e-4))
  scale = (2.0 ** np.ceil(np.log2((amax / np.float32(448)).astype(np.float64)))).astype(np.float32)
  q = (xb / scale).astype(F8).astype(np.float32)
  return (q * scale).reshape(x.shape)


# --- E2M1 grid ------------------------------------------------------------------------------


def test_round_to_e2m1_matches_float4_cast():
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.uniform(-7, 7, 20000), rng.uniform(-0.6, 0.6, 2000)]).astype(np.float32)
  _assert_bitwise(jax.jit(quant.round_to_e2m1)(jnp.asarray(x)), x.astype(F4).astype(np.float32))


def test_round_to_e2m1_ties_follow_spec():
  # §9.1: ties at 0.25, 1.25, 2.5, 5.0 go down (even code); at 0.75, 1.75, 3.5 they go up.
  ties = np.array([0.25, 1.25, 2.5, 5.0, 0.75, 1.75, 3.5], np.float32)
  want = np.array([0.0, 1.0, 2.0, 4.0, 1.0, 2.0, 4.0], np.float32)
  _assert_bitwise(quant.round_to_e2m1(jnp.asarray(ties)), want)
  _assert_bitwise(quant.round_to_e2m1(jnp.asarray(-ties)), -want)
  # Just off the ties the nearest value wins; beyond 6 saturates.
  near = np.array([0.2501, 1.2501, 2.5001, 5.0001, 0.7499, 1.7499, 3.4999, 6.5, 100.0], np.float32)
  _assert_bitwise(quant.round_to_e2m1(jnp.asarray(near)),
                  np.array([0.5, 1.5, 3.0, 6.0, 0.5, 1.5, 3.0, 6.0, 6.0], np.float32))


def test_round_to_e2m1_bfloat16_keeps_dtype():
  x = jnp.asarray(np.random.default_rng(1).uniform(-7, 7, 512), jnp.bfloat16)
  y = quant.round_to_e2m1(x)
  assert y.dtype == jnp.bfloat16
  _assert_bitwise(y.astype(jnp.float32), np.asarray(x, np.float32).astype(F4).astype(np.float32))


# --- block formats --------------------------------------------------------------------------


@pytest.mark.parametrize("fq, ref, block", [(quant.fp4_main_kv, ref_fp4_main_kv, 16),
                                            (quant.mxfp4, ref_mxfp4, 32),
                                            (quant.fp8_swa, ref_fp8_swa, 32)])
def test_block_format_matches_ml_dtypes_casts(fq, ref, block):
  x = _kv_like(np.random.default_rng(block), (3, 5, 128), block)
  # Under jit (as in the model) XLA rewrites x / broadcast(s) into x * (1/s) and may drop
  # f32 -> f8 -> f32 round trips; the result must still be the spec's.
  got = jax.jit(fq)(jnp.asarray(x))
  assert got.dtype == jnp.float32 and got.shape == x.shape
  _assert_bitwise(got, ref(x))


def test_fp4_main_kv_exact_ties_under_jit():
  # Blocks whose quotients x / scale land exactly on the E2M1 ties (scale = 1.875, 0.625, ...):
  # a reciprocal multiply misses some of them; the spec's division does not.
  rng = np.random.default_rng(11)
  grid = np.arange(8, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  scales = rng.choice(grid, 4096)
  x = ties[rng.integers(0, 7, (4096, 15))] * scales[:, None] * rng.choice([-1, 1], (4096, 15))
  x = np.concatenate([x, 6 * scales[:, None]], axis=1).astype(np.float32)  # amax / 6 = scale
  exact = np.all(x / scales[:, None] == x.astype(np.float64) / scales[:, None].astype(np.float64))
  assert exact  # the inputs are exact tie multiples of their block scale
  _assert_bitwise(jax.jit(quant.fp4_main_kv)(jnp.asarray(x)), ref_fp4_main_kv(x))


def test_div_short_correctly_rounded_under_jit():
  rng = np.random.default_rng(12)
  grid = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  s = np.concatenate([grid, [6.0]]).astype(np.float32)[:, None]
  x = (rng.standard_normal((1, 3000)) * s * 3).astype(np.float32)
  _assert_bitwise(jax.jit(quant.div_short)(jnp.asarray(x), jnp.asarray(s)), x / s)


def test_fp4_main_kv_exercises_clipping_and_subnormal_scales():
  # The spec notes the rounded E4M3 scale clips the block max in about half of the blocks and the
  # 6·2^-9 floor gives subnormal scales: check the test inputs really reach both regimes.
  x = _kv_like(np.random.default_rng(16), (3, 5, 128), 16).reshape(-1, 16)
  amax = np.abs(x).max(-1)
  scale = (np.maximum(amax, 6 * 2.0 ** -9) / 6).astype(np.float32).astype(F8).astype(np.float32)
  clipped = amax / scale > 6
  assert 0.2 < clipped.mean() < 0.8
  assert (scale < 2.0 ** -6).any()


def test_fp4_main_kv_scale_saturates_beyond_e4m3_range():
  # Outside the spec's range (amax > 2688) the scale saturates at 448 instead of becoming NaN.
  x = jnp.asarray(np.linspace(-5000, 4000, 16, dtype=np.float32))
  y = np.asarray(jax.jit(quant.fp4_main_kv)(x))
  assert np.isfinite(y).all() and y.max() == 6 * 448 and y.min() == -6 * 448


def test_block_formats_bfloat16():
  x = _kv_like(np.random.default_rng(7), (4, 64), 32)
  xb = jnp.asarray(x, jnp.bfloat16)
  x32 = np.asarray(xb, np.float32)
  for fq, ref in [(quant.fp4_main_kv, ref_fp4_main_kv), (quant.mxfp4, ref_mxfp4),
                  (quant.fp8_swa, ref_fp8_swa)]:
    got = jax.jit(fq)(xb)
    assert got.dtype == jnp.bfloat16
    _assert_bitwise(got.astype(jnp.float32), ref(x32).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_block_size_must_divide_last_axis():
  with pytest.raises(ValueError, match="multiple of the block size 16"):
    quant.fp4_main_kv(jnp.ones((2, 24)))


# --- straight-through estimator -------------------------------------------------------------


@pytest.mark.parametrize("fq", [quant.fp4_main_kv, quant.mxfp4, quant.fp8_swa])
def test_fake_quant_forward_exact_and_gradient_identity(fq):
  rng = np.random.default_rng(3)
  x = jnp.asarray(_kv_like(rng, (2, 64), 32))
  w = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
  _assert_bitwise(jax.jit(quant.fake_quant, static_argnums=1)(x, fq), jax.jit(fq)(x))
  g = jax.jit(jax.grad(lambda v: jnp.sum(w * quant.fake_quant(v, fq))))(x)
  _assert_bitwise(g, w)


def test_fake_quant_bfloat16_forward_exact():
  x = jnp.asarray(_kv_like(np.random.default_rng(4), (8, 64), 16), jnp.bfloat16)
  y = jax.jit(quant.fake_quant, static_argnums=1)(x, quant.fp4_main_kv)
  assert y.dtype == jnp.bfloat16
  _assert_bitwise(y.astype(jnp.float32), ref_fp4_main_kv(np.asarray(x, np.float32)))


def test_fake_quant_main_kv_op_reference_policy():
  x = jnp.asarray(_kv_like(np.random.default_rng(5), (4, 32), 16))
  op = lambda v, policy: dispatch.call("fake_quant_fp4_main_kv", v, policy=policy)  # noqa: E731
  _assert_bitwise(jax.jit(op, static_argnums=1)(x, "reference"), ref_fp4_main_kv(np.asarray(x)))
  with pytest.raises(ValueError, match="op fake_quant_fp4_main_kv: policy 'cuda' is not one of"):
    op(x, "cuda")


# --- stored sizes (docs/design.md §10) ------------------------------------------------------------


def test_byte_sizes_give_890_bytes_per_token():
  assert quant.fp4_e4m3_16_bytes(512) == 256 + 32
  assert quant.mxfp4_bytes(128) == 64 + 4
  assert quant.fp8_32_bytes(512) == 528  # SWA entry, §10: 128 × 528 B per layer and sequence
  entries_per_token = 3 * 0.5 + 1 * 1.0
  assert entries_per_token * (quant.fp4_e4m3_16_bytes(512) + quant.mxfp4_bytes(128)) == 890
  with pytest.raises(ValueError):
    quant.mxfp4_bytes(48)


def test_round_to_e4m3_matches_float8_cast():
  rng = np.random.default_rng(13)
  grid = np.arange(0, 127, dtype=np.uint8).view(F8).astype(np.float32)
  mids = (grid[:-1] + grid[1:]) / 2  # exact ties between neighbours
  x = np.concatenate([2.0 ** rng.uniform(-14, np.log2(448), 30000), grid, mids, [0.0, 448.0]])
  x = (x * rng.choice([-1, 1], x.shape)).astype(np.float32)
  want = x.astype(F8).astype(np.float32)
  _assert_bitwise(jax.jit(quant.round_to_e4m3)(jnp.asarray(x)), want)
