"""pallas_kernels/fp4.py (interpret mode) against dsv41_jax.quant and the ml_dtypes casts."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels
from dsv41_jax import quant
from pallas_kernels import fp4


def _bits_equal(got, want):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  bad = got.view(np.uint32) != want.view(np.uint32)
  assert not bad.any(), f"{bad.sum()} differ: got {got[bad][:5]} want {want[bad][:5]}"


def _kv(seed, shape):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  mag = 10.0 ** rng.uniform(-5, 2, shape[:-1] + (shape[-1] // 16, 1))
  return (x.reshape(*shape[:-1], -1, 16) * mag).reshape(shape).astype(np.float32)


def test_e2m1_thresholds_match_float4_cast():
  a = np.concatenate([np.random.default_rng(0).uniform(0, 6, 20000),
                      [0, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, 6]]).astype(np.float32)
  _bits_equal(fp4.e2m1_magnitude(jnp.asarray(a)), a.astype(ml_dtypes.float4_e2m1fn))


def test_e4m3_rounding_matches_float8_cast():
  rng = np.random.default_rng(1)
  s = (2.0 ** rng.uniform(-10, np.log2(448), 50000)).astype(np.float32)
  grid = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints between neighbouring E4M3 values
  s = np.concatenate([s, grid, ties, [448.0]]).astype(np.float32)
  _bits_equal(fp4.e4m3_round_positive(jnp.asarray(s)), s.astype(ml_dtypes.float8_e4m3fn))


@pytest.mark.parametrize("shape, block_rows", [((2, 9, 64), 16), ((5, 48), 4)])
def test_kernel_matches_reference_bitwise(shape, block_rows):
  # (2, 9, 64): 72 blocks -> 5 programs with a padded tail; (5, 48): 15 blocks, 4 programs.
  x = jnp.asarray(_kv(sum(shape), shape))
  got = fp4.fp4_main_kv_pallas(x, block_rows=block_rows, interpret=True)
  assert got.shape == x.shape and got.dtype == x.dtype
  _bits_equal(got, quant.fp4_main_kv(x))


def test_kernel_bfloat16_and_negative_zero():
  x = _kv(3, (4, 64))
  x[0, :3] = [-0.0, 0.0, -1e-30]
  xb = jnp.asarray(x, jnp.bfloat16)
  got = fp4.fp4_main_kv_pallas(xb, block_rows=8, interpret=True)
  assert got.dtype == jnp.bfloat16
  _bits_equal(got.astype(jnp.float32), quant.fp4_main_kv(xb).astype(jnp.float32))
  assert np.signbit(np.asarray(got[0, 0], np.float32))


def test_fake_quant_switch_forward_and_straight_through_gradient():
  rng = np.random.default_rng(4)
  x = jnp.asarray(_kv(4, (3, 32)))
  w = jnp.asarray(rng.standard_normal((3, 32)).astype(np.float32))
  kern = pallas_kernels.select("fp4_main_kv_fake_quant", "pallas", None)
  assert kern is fp4.fp4_main_kv_fake_quant
  _bits_equal(quant.fake_quant_main_kv(x, "pallas"), quant.fake_quant_main_kv(x, "xla"))
  g_kernel = jax.grad(lambda v: jnp.sum(w * quant.fake_quant_main_kv(v, "pallas")))(x)
  g_ref = jax.grad(lambda v: jnp.sum(w * quant.fake_quant_main_kv(v, "xla")))(x)
  _bits_equal(g_kernel, w)
  _bits_equal(g_ref, w)


def test_div_rn_is_correctly_rounded_with_a_coarse_reciprocal():
  # On the GPU 1/s is approximate; emulate that with a reciprocal off by a few ulps and check the
  # corrected quotient still equals the correctly rounded x / s for every E4M3 divisor.
  rng = np.random.default_rng(5)
  grid = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  s = np.concatenate([grid, [6.0]]).astype(np.float32)[:, None]
  x = (rng.standard_normal((1, 4000)) * s * 3).astype(np.float32)
  want = (x.astype(np.float64) / s.astype(np.float64)).astype(np.float32)
  assert (want != x / s).sum() == 0  # numpy's float32 division is correctly rounded
  got = np.asarray(jax.jit(fp4.div_rn)(jnp.asarray(x), jnp.asarray(s)))
  _bits_equal(got, want)

  def coarse_div(x, s):  # same algorithm, reciprocal perturbed by 3 ulps
    r = np.nextafter(np.nextafter(np.nextafter(np.float32(1) / s, 2), 2), 2).astype(np.float32)
    q0 = (x * r).astype(np.float32)
    head = (q0.view(np.int32) & ~0xF).view(np.float32)
    tail = q0 - head
    rho = (x - head * s) - tail * s
    return (q0 + rho * r).astype(np.float32)
  _bits_equal(coarse_div(x, s), want)
