"""pallas_kernels/mhc_rows.py (interpret mode) against the op's reference site (pallas_kernels.ops.mhc)
and the float64 schedule restatement; its lowering for CUDA (Triton blocks at s3's widths).

Float32 streams: the same float32 formulas, sums in another order: X' and x to float32 rounding,
coefficients 1e-5 after 20 Sinkhorn rounds, every gradient within 2e-5 of `jax.grad` of the
reference. Bfloat16 streams: X' within one bfloat16 ulp, x to float32 rounding of the same rounded
X'; the gradients differ from the reference's by its bfloat16 roundings (it sums the cotangents of a
bfloat16 X' in bfloat16, the kernel in float32 before one rounding), so they are compared with the
float32-stream gradients of the same values, which both approximate: the kernel's must be no
further from them than the reference's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mhc_rows
from pallas_kernels.ops import mhc
from tests.dsv41_jax.layers.test_mhc import ref_hc
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls
from tests.pallas_kernels.test_mhc import (KW, SITE, _close_grads, _inputs, _vjp_all,
                                           close_site_outputs)

# Small tiles so that the tests' 18 tokens leave a padded block and d = 32 takes two chunks.
TILES = dict(fwd_tiles=(8, 16, 4), bwd_tiles=(16, 16, 4))


def _rows(*a, **kw):
  return mhc_rows.hc_site(*a, **kw, **TILES)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_site_matches_reference_and_float64(dtype):
  args = _inputs(11, lead=(2, 9), dtype=dtype)
  got = _rows(*args, **KW)
  close_site_outputs(got, mhc.hc_site(*args, **KW), dtype)
  # The coefficients against float64 from the X' the kernel wrote (tests/dsv41_jax/layers/test_mhc.py).
  Xn = np.asarray(got[0], np.float64)
  for g, w in zip(got[2:], ref_hc(Xn, *(np.asarray(a, np.float64) for a in args[5:8]),
                                  iters=KW["iters"], hc_eps=KW["hc_eps"], norm_eps=KW["norm_eps"])):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)


def test_rows_site_gradients_float32_streams():
  args = _inputs(12, lead=(2, 9))
  kw = dict(KW, iters=5)
  _close_grads(_vjp_all(lambda *a: _rows(*a, **kw), args),
               _vjp_all(lambda *a: mhc.hc_site(*a, **kw), args), SITE)


def test_rows_site_gradients_bfloat16_streams_no_worse_than_the_reference():
  args = _inputs(13, lead=(2, 9), dtype=jnp.bfloat16)
  exact_args = (args[0].astype(jnp.float32), args[1].astype(jnp.float32), *args[2:])
  kw = dict(KW, iters=5)
  got = _vjp_all(lambda *a: _rows(*a, **kw), args)
  ref = _vjp_all(lambda *a: mhc.hc_site(*a, **kw), args)
  exact = _vjp_all(lambda *a: mhc.hc_site(*a, **kw), exact_args)
  for name, g, r, e in zip(SITE, got, ref, exact):
    assert g.shape == r.shape and g.dtype == r.dtype, name
    g, r, e = (np.asarray(a, np.float64) for a in (g, r, e))
    scale = np.abs(e).max()
    # Both within a few bfloat16 ulps of the scale of the float32-stream gradient ...
    assert np.abs(g - e).max() <= 2 ** -6 * scale, name
    # ... the kernel's summed error no larger than the reference's (2 % slack for ties).
    assert np.abs(g - e).sum() <= 1.02 * np.abs(r - e).sum() + 1e-6 * scale, name


def test_rows_site_padding_and_default_tiles():
  """A token count off both blocks (5 tokens, default 8- and 32-token blocks): padded rows change
  nothing, forward or backward."""
  args = _inputs(14, lead=(1, 5), d=32)
  kw = dict(KW, iters=3)
  got, want = mhc_rows.hc_site(*args, **kw), mhc.hc_site(*args, **kw)
  for g, w in zip(got[:2], want[:2]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-6)
  _close_grads(_vjp_all(lambda *a: mhc_rows.hc_site(*a, **kw), args),
               _vjp_all(lambda *a: mhc.hc_site(*a, **kw), args), SITE)


def test_rows_forward_blocks_shrink_for_wide_rows(monkeypatch):
  """The forward's token rows halve until a block's y fits `FWD_Y_VALUES` (widths up to 5120 keep
  8, 4 or 2 rows); a halved block (the bound lowered so d = 32 takes 2 rows) changes no output."""
  assert [mhc_rows.forward_tiles(d)[0] for d in (1024, 1536, 2048, 4096, 5120)] == [8, 8, 8, 4, 2]
  assert mhc_rows.forward_tiles(1 << 20) == (1, 256, 8)
  args = _inputs(15, lead=(1, 5), d=32)
  kw = dict(KW, iters=3, bwd_tiles=(16, 16, 4))
  want = mhc_rows.hc_site(*args, **kw, fwd_tiles=(2, 16, 4))
  monkeypatch.setattr(mhc_rows, "FWD_Y_VALUES", 64)
  assert mhc_rows.forward_tiles(32, (8, 16, 4)) == (2, 16, 4)
  monkeypatch.setattr(mhc_rows, "FWD_TILES", (8, 16, 4))
  for g, w in zip(mhc_rows.hc_site(*args, **kw), want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_rows_site_lowers_for_cuda_at_s3_width():
  """d = 1024, n = 4, bfloat16 streams, the default tiles: forward and gradient lower to Triton (the
  gradient program: the rows' forward, the gates' backward, the rows' backward)."""
  rng = np.random.default_rng(0)
  n, d = 4, 1024
  X = jnp.asarray(rng.standard_normal((1, 64, n, d)), jnp.bfloat16)
  F = jnp.asarray(rng.standard_normal((1, 64, d)), jnp.bfloat16)
  f32 = lambda *s: jnp.asarray(rng.uniform(0.1, 1.0, s), jnp.float32)  # noqa: E731
  args = (X, F, f32(1, 64, n), f32(1, 64, n, n), f32(1, 64, n), 0.01 * f32((2 + n) * n, n * d),
          f32((2 + n) * n), f32(3), f32(d))
  site = lambda *a: mhc_rows.hc_site(*a, **KW, interpret=False)  # noqa: E731
  assert triton_calls(lower_for_cuda(site, *args)) == 2
  loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in site(*a))  # noqa: E731
  assert triton_calls(lower_for_cuda(jax.grad(loss, argnums=tuple(range(9))), *args)) == 3


def test_rows_unsupported_shapes_name_the_reason(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  X = lambda n, d: jax.ShapeDtypeStruct((2, 8, n, d), jnp.bfloat16)  # noqa: E731
  assert mhc_rows.unsupported_reason(X(4, 1024)) is None
  assert mhc_rows.unsupported_reason(X(4, 64)) is None           # one chunk of 64
  assert "hc_mult 3" in mhc_rows.unsupported_reason(X(3, 1024))
  assert "hidden size 96" in mhc_rows.unsupported_reason(X(4, 96))
  assert "hidden size 1000" in mhc_rows.unsupported_reason(X(4, 1000))


def test_rows_site_under_layer_remat_runs_the_mix_once():
  """Under the model's remat policy the compiled gradient program holds the mix GEMM over X' once
  (its output named `ops.mhc.MIX`, so the recomputed forward's copy has no reader) and d fn's
  product once, as without remat (gX''s mix term is the kernel's own dot, on blocks)."""
  from dsv41_jax import model as M
  args = _inputs(15, lead=(2, 9))
  kw = dict(KW, iters=5)
  n_d = args[0].shape[-2] * args[0].shape[-1]
  shapes = ("= f32[18,24]{", f"= f32[24,{n_d}]{{")   # the mix [tokens, m], d fn [m, n·d]

  def loss(*a):
    return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in _rows(*a, **kw))

  def products(f):
    text = jax.jit(jax.grad(f, argnums=(0, 5))).lower(*args).compile().as_text()
    return sum(" dot(" in line and any(s in line for s in shapes) for line in text.splitlines())

  assert products(loss) == 2
  assert products(jax.checkpoint(loss, prevent_cse=False, policy=M.remat_policy)) == 2
