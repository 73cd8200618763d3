"""pallas_kernels/mhc_stream.py (interpret mode) against the op's reference
(pallas_kernels.ops.mhc.hc_site), a float64 restatement of the site, and the Triton lowering.

Shapes: 2 × 40 tokens (not a multiple of the 16-token block: a padded tail), n = 4, d = 256 in
two 128-channel slices, so every per-token sum crosses slices and blocks.

Forward: the same float32 formulas with sums in another order, so X' is within float32 rounding
(bfloat16 streams: at most one bfloat16 ulp, in under 1 % of the entries, where a contraction
into an FMA moves a value across a rounding midpoint; test_mhc.py's tolerances), x within float32
rounding and the coefficients 1e-5 after 20 Sinkhorn rounds (bfloat16 streams: of the reference's
collapse + norm and coefficients of the kernel's own X', which an X' ulp moves); n = 1, 2, 8 as well.

Backward: float32 streams against `jax.grad` of the reference at test_mhc.py's 2e-5. Bfloat16
streams against float64 autodiff of the site (the bfloat16 rounding of X' passed straight
through, as autodiff of `astype` does; X'’s cotangent bfloat16 values, as it arrives): the
stream gradients gX, gF within one bfloat16 ulp (the kernel sums X'’s cotangent in float32 and
rounds once; the reference rounds and sums its parts in bfloat16, 9 to 14 ulps off at the 99th
percentile here, far more where they cancel), the float32 gradients to 2e-5 of their scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mhc_stream
from pallas_kernels.ops import mhc
from pallas_kernels.ops.norm import rms_norm
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls
from tests.pallas_kernels.test_mhc import (KW, SITE, _close_coefficients, _close_grads, _inputs,
                                           _vjp_all, _within_bf16_ulp)

LEAD, N, D = (2, 40), 4, 256
GRAD_KW = dict(KW, iters=5)


def _stream(**kw):
  return lambda *a: mhc_stream.hc_site(*a, **kw)


def _reference(**kw):
  return lambda *a: mhc.hc_site(*a, **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_reference(dtype):
  args = _inputs(4, lead=LEAD, d=D, dtype=dtype)
  got = jax.jit(_stream(**KW))(*args)
  want = jax.jit(_reference(**KW))(*args)
  assert got[0].dtype == want[0].dtype == dtype and got[0].shape == want[0].shape
  if dtype == jnp.float32:
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-6, atol=1e-6)
  else:
    _within_bf16_ulp(got[0], want[0])
  assert got[1].dtype == want[1].dtype == jnp.float32 and got[1].shape == want[1].shape
  if dtype == jnp.bfloat16:
    # x is the collapse + norm of X' as stored: where the kernel's X' is one bfloat16 ulp from
    # the reference's (a rounding midpoint, which jax 0.11's CPU contracts differently from
    # 0.10's), x moves by that ulp times pre (2.5e-4 relative at 2 of 20,480 entries, measured).
    # So x is held to float32 rounding of the reference's collapse + norm of the kernel's own X'.
    X, F, post, comb, pre, fn, base, scale, w = args
    # The coefficients likewise, from the kernel's X' (that token's mix moves with the ulp).
    want_x = rms_norm(mhc.collapse(got[0], pre), w, KW["norm_eps"])
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want_x), rtol=2e-6, atol=1e-6)
    _close_coefficients(got[2:], mhc.hc_coefficients(got[0], fn, base, scale, **KW))
  else:
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-6, atol=1e-6)
    _close_coefficients(got[2:], want[2:])


def test_float32_stream_gradients_match_reference():
  args = _inputs(5, lead=LEAD, d=D, dtype=jnp.float32)
  _close_grads(_vjp_all(_stream(**GRAD_KW), args), _vjp_all(_reference(**GRAD_KW), args), SITE)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_other_stream_counts(n):
  # The row widths of `_widths` at every power-of-two n the GPU takes: 20 tokens (a padded
  # block), d = 64 in two 32-channel slices, float32 streams.
  args = _inputs(8, lead=(1, 20), n=n, d=64)
  got = _stream(**GRAD_KW, block_d=32)(*args)
  want = _reference(**GRAD_KW)(*args)
  for g, w in zip(got[:2], want[:2]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-6)
  _close_coefficients(got[2:], want[2:])
  grads = _vjp_all(_stream(**GRAD_KW, block_d=32), args), _vjp_all(_reference(**GRAD_KW), args)
  # With one stream y = pre₀ X'₀, and the norm's gradient is orthogonal to y: pre's is 0 up to
  # float32 rounding in both (no scale to compare against).
  keep = [i for i, name in enumerate(SITE) if n > 1 or name != "pre"]
  _close_grads(*([g[i] for i in keep] for g in grads), [SITE[i] for i in keep])


def _site64(Xn_stored, X, F, post, comb, pre, fn, base, scale, w, *, iters, hc_eps, norm_eps):
  """The site in float64 from the spec (einsums), X' = its exact value with the stored
  (rounded) X' substituted forward and passed straight through backward."""
  exact = (jnp.einsum("...jk,...jd->...kd", comb, X) + post[..., None] * F[..., None, :])
  Xn = exact + jax.lax.stop_gradient(Xn_stored - exact)
  y = jnp.einsum("...kd,...k->...d", Xn, pre)
  x = y / jnp.sqrt(jnp.mean(y * y, -1, keepdims=True) + norm_eps) * w
  *lead, n, d = Xn.shape
  xhat = Xn.reshape(*lead, n * d)
  mix = (xhat @ fn.T) / jnp.sqrt(jnp.mean(xhat * xhat, -1, keepdims=True) + norm_eps)
  sig = lambda v: 1 / (1 + jnp.exp(-v))  # noqa: E731
  pre_n = sig(mix[..., :n] * scale[0] + base[:n]) + hc_eps
  post_n = 2 * sig(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
  z = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*lead, n, n)
  c = jnp.exp(z - z.max(-1, keepdims=True))
  c = c / c.sum(-1, keepdims=True) + hc_eps
  c = c / (c.sum(-2, keepdims=True) + hc_eps)
  for _ in range(iters - 1):
    c = c / (c.sum(-1, keepdims=True) + hc_eps)
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
  return Xn, x, pre_n, post_n, c


def _grads64(Xn_stored, args, ws):
  with jax.enable_x64(True):
    a64 = [jnp.asarray(np.asarray(a, np.float32), jnp.float64) for a in args]
    xn64 = jnp.asarray(np.asarray(Xn_stored, np.float32), jnp.float64)

    def loss(*a):
      outs = _site64(xn64, *a, **GRAD_KW)
      return sum(jnp.sum(jnp.asarray(w, jnp.float64) * o) for w, o in zip(ws, outs))
    return [np.asarray(g) for g in jax.grad(loss, argnums=tuple(range(len(a64))))(*a64)]


def _grads(f, args, ws):
  def loss(*a):
    return sum(jnp.sum(w * o.astype(jnp.float32)) for w, o in zip(ws, f(*a)))
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def _bf16_ulps(got, want):
  """|got − want| in bfloat16 ulps of want (float64), elementwise."""
  ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
  return np.abs(np.asarray(got, np.float64) - want) / ulp


def test_bfloat16_stream_gradients_against_float64():
  args = _inputs(6, lead=LEAD, d=D, dtype=jnp.bfloat16)
  rng = np.random.default_rng(7)
  outs = jax.eval_shape(_reference(**GRAD_KW), *args)
  # X'’s weight in bfloat16 values: its cotangent is rounded to X'’s dtype on the way in.
  ws = [jnp.asarray(jnp.asarray(rng.standard_normal(o.shape), o.dtype), jnp.float32) for o in outs]
  got = _grads(_stream(**GRAD_KW), args, ws)
  ref = _grads(_reference(**GRAD_KW), args, ws)
  want = _grads64(jax.jit(_stream(**GRAD_KW))(*args)[0], args, ws)
  for name, g, r, w in zip(SITE, got, ref, want):
    assert g.shape == r.shape == w.shape and g.dtype == r.dtype, name
    scale = np.abs(w).max()
    if name in ("X", "F"):   # bfloat16: rounded once from a float32 sum
      tiny = np.abs(w) < 1e-5 * scale   # float32 cancellation below any bfloat16 ulp
      assert (_bf16_ulps(g, w)[~tiny] <= 1.0).all(), name
      assert (np.abs(np.asarray(g, np.float64) - w)[tiny] <= 1e-5 * scale).all(), name
      # The reference, rounding its cotangents of X' in bfloat16, is no closer.
      assert _bf16_ulps(r, w)[~tiny].max() >= _bf16_ulps(g, w)[~tiny].max(), name
    else:
      np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-5, atol=2e-5 * scale,
                                 err_msg=name)


def test_unsupported_reasons_and_errors():
  X = jnp.zeros((1, 8, 4, 192), jnp.bfloat16)
  fn = jnp.zeros((24, 4 * 192), jnp.float32)
  assert "multiple of the slice 128" in mhc_stream.unsupported_reason(X, None, None, None, None, fn)
  assert mhc_stream.unsupported_reason(X, None, None, None, None, fn, block_d=64) is None
  assert "block_tokens 24" in mhc_stream.unsupported_reason(X, fn=None, block_tokens=24)
  assert "float16" in mhc_stream.unsupported_reason(X.astype(jnp.float16))
  args = _inputs(1, lead=(1, 8), d=192)
  with pytest.raises(ValueError, match="multiple of the slice"):
    mhc_stream.hc_site(*args, **KW)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_for_cuda(dtype):
  # Triton lowering on the CPU host (interpret mode cannot see it): forward = the stream kernel
  # and the gates; the gradient: the stream kernel, the h pass, the main pass and the gates'
  # backward (the gates' forward output is dead there: their VJP rebuilds from the logits).
  args = _inputs(2, lead=(2, 32), d=D, dtype=dtype)
  fwd = _stream(**KW, interpret=False)
  lowered = lower_for_cuda(fwd, *args)
  assert "mhc_stream_fwd" in lowered.as_text() and triton_calls(lowered) == 2

  def loss(*a):
    return sum(jnp.sum(o.astype(jnp.float32)) for o in fwd(*a))
  lowered = lower_for_cuda(jax.grad(loss, argnums=tuple(range(9))), *args)
  text = lowered.as_text()
  assert all(k in text for k in ("mhc_stream_h", "mhc_stream_bwd", "mhc_gates_bwd"))
  assert triton_calls(lowered) == 4
