"""pallas_kernels/fake_quant.py (interpret mode) against the op pallas_kernels.ops.quant and the ml_dtypes casts."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels import dispatch
from pallas_kernels import fake_quant as fq

REFERENCE = {"fp4_main_kv": quant.fp4_main_kv, "mxfp4": quant.mxfp4, "fp8_swa": quant.fp8_swa}
E4M3_GRID = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _bits_equal(got, want):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  bad = got.view(np.uint32) != want.view(np.uint32)
  assert not bad.any(), f"{bad.sum()} differ: got {got[bad][:5]} want {want[bad][:5]}"


def _inputs(fmt, seed, n_blocks):
  """[n_blocks, block] float32: random blocks at magnitudes 1e-30 .. 1e30, plus edge blocks:
  all zeros, ±0 and tiny values, and blocks whose elements sit exactly on the format's ties."""
  rng = np.random.default_rng(seed)
  b = fq.BLOCK[fmt]
  x = rng.standard_normal((n_blocks, b)) * 10.0 ** rng.uniform(-30, 30, (n_blocks, 1))
  if fmt == "fp4_main_kv":  # the interesting range: subnormal E4M3 scales up to saturation (2688)
    x = rng.standard_normal((n_blocks, b)) * 10.0 ** rng.uniform(-5, 3.6, (n_blocks, 1))
  x[0] = 0.0
  x[1, :4] = [-0.0, 0.0, -1e-30, 1e-38]
  x[1, 4:] = rng.standard_normal(b - 4) * 1e-36
  ties = {"fp4_main_kv": [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 6.0],
          "mxfp4": [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 6.0],
          "fp8_swa": list((E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2)}[fmt]
  top = 448.0 if fmt == "fp8_swa" else 6.0
  for r in range(2, min(n_blocks, 40)):
    # A scale hit exactly (block max = top · scale) and elements on ties times that scale.
    s = rng.choice(E4M3_GRID[:-1]) if fmt == "fp4_main_kv" else 2.0 ** rng.integers(-20, 20)
    v = rng.choice(ties, b) * s * rng.choice([-1, 1], b)
    v[rng.integers(b)] = top * s
    x[r] = v
  return x.astype(np.float32)


@pytest.mark.parametrize("fmt", list(REFERENCE))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference_bitwise(fmt, dtype):
  x = jnp.asarray(_inputs(fmt, hash((fmt, str(dtype))) % 2**32, 256), dtype)
  got = fq.fake_quant_pallas(x.reshape(-1, 4 * fq.BLOCK[fmt]), fmt=fmt, block_rows=64,
                             interpret=True).reshape(x.shape)
  assert got.dtype == dtype
  _bits_equal(got, REFERENCE[fmt](x))
  _bits_equal(got, jax.jit(REFERENCE[fmt])(x))


@pytest.mark.parametrize("fmt", list(REFERENCE))
def test_kernel_matches_float8_and_float4_casts(fmt):
  # Independent of quant.py: the ml_dtypes casts with the spec's scales (§9.2) on random blocks.
  x = _inputs(fmt, 7, 128)[2:].astype(np.float64).astype(np.float32)
  amax = np.abs(x).max(-1, keepdims=True)
  if fmt == "fp4_main_kv":
    s = (np.maximum(amax, np.float32(6 * 2.0 ** -9)) / np.float32(6))
    s = np.minimum(s, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = np.clip(x / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * s
  else:
    top, floor, dt = ((6.0, 6 * 2.0 ** -126, ml_dtypes.float4_e2m1fn) if fmt == "mxfp4"
                      else (448.0, 1e-4, ml_dtypes.float8_e4m3fn))
    s = np.exp2(np.ceil(np.log2(np.maximum(amax.astype(np.float64), floor) / top)))
    want = (np.clip(x / s, -top, top).astype(dt).astype(np.float64) * s).astype(np.float32)
  _bits_equal(fq.fake_quant_pallas(jnp.asarray(x), fmt=fmt, block_rows=32, interpret=True), want)


def test_padded_rows_and_leading_shape():
  # 3·5·3 = 45 blocks of 32: no power of two ≥ 64 tiles them, so the rows are padded to 64.
  x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 5, 96)), jnp.bfloat16)
  for fmt in ("mxfp4", "fp8_swa"):
    _bits_equal(fq.fake_quant_pallas(x, fmt=fmt, block_rows=64, interpret=True),
                REFERENCE[fmt](x))


@pytest.mark.parametrize("name, fmt", [("fp4_main_kv_fake_quant", "fp4_main_kv"),
                                       ("mxfp4_fake_quant", "mxfp4"),
                                       ("fp8_swa_fake_quant", "fp8_swa")])
def test_switch_forward_and_straight_through_gradient(name, fmt):
  rng = np.random.default_rng(4)
  x = jnp.asarray(_inputs(fmt, 5, 6).reshape(3, -1))
  w = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))
  impl, kern = dispatch.choose(f"fake_quant_{fmt}", "kernel", x)
  assert impl == f"pallas_kernels.fake_quant:{name}" and kern.__wrapped__ is getattr(fq, name)
  ref = lambda v: quant.fake_quant(v, REFERENCE[fmt])  # noqa: E731
  _bits_equal(kern(x), ref(x))
  g_kernel = jax.jit(jax.grad(lambda v: jnp.sum(w * kern(v))))(x)
  _bits_equal(g_kernel, w)
  _bits_equal(jax.grad(lambda v: jnp.sum(w * ref(v)))(x), w)


def test_quant_ops_switch():
  x = jnp.asarray(_inputs("mxfp4", 6, 8).reshape(2, -1))
  for fmt in ("fp4_main_kv", "mxfp4", "fp8_swa"):
    site = lambda v, policy: dispatch.call(f"fake_quant_{fmt}", v, policy=policy)  # noqa: E731
    _bits_equal(site(x, "kernel"), site(x, "reference"))
    _bits_equal(site(x, "reference"), REFERENCE[fmt](x))


def test_e2m1_and_e4m3_helpers_match_casts():
  rng = np.random.default_rng(0)
  a = np.concatenate([rng.uniform(0, 6, 20000),
                      [0, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, 6]]).astype(np.float32)
  _bits_equal(fq.e2m1_magnitude(jnp.asarray(a)), a.astype(ml_dtypes.float4_e2m1fn))
  s = (2.0 ** rng.uniform(-10, np.log2(448), 50000)).astype(np.float32)
  s = np.concatenate([s, E4M3_GRID, (E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2, [448.0]])
  s = s[s >= 2.0 ** -9].astype(np.float32)
  _bits_equal(fq.e4m3_round_positive(jnp.asarray(s)), s.astype(ml_dtypes.float8_e4m3fn))


def test_div_rn_is_correctly_rounded_with_a_coarse_reciprocal():
  # On the GPU 1/s is approximate; emulate it with a reciprocal 3 ulps off and check the corrected
  # quotient still equals the correctly rounded x / s for every E4M3 divisor, 6 and 448.
  rng = np.random.default_rng(5)
  s = np.concatenate([E4M3_GRID, [6.0]]).astype(np.float32)[:, None]
  x = (rng.standard_normal((1, 4000)) * s * 3).astype(np.float32)
  want = (x.astype(np.float64) / s.astype(np.float64)).astype(np.float32)
  _bits_equal(jax.jit(fq.div_rn)(jnp.asarray(x), jnp.asarray(s)), want)

  def coarse_div(x, s):  # the same algorithm, reciprocal perturbed by 3 ulps
    r = np.nextafter(np.nextafter(np.nextafter(np.float32(1) / s, 2), 2), 2).astype(np.float32)
    q0 = (x * r).astype(np.float32)
    head = (q0.view(np.int32) & ~0xF).view(np.float32)
    rho = (x - head * s) - (q0 - head) * s
    return (q0 + rho * r).astype(np.float32)
  _bits_equal(coarse_div(x, s), want)
