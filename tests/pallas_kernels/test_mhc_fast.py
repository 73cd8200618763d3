"""pallas_kernels/mhc_fast.py against the ops' references (dsv41_jax.layers.mhc) and float64, and the
ops' expand / collapse (broadcast multiply-adds, hand VJPs) against their einsum forms.

Forward: the same float32 formulas with sums in another order, so X' and x agree to float32
rounding (bfloat16 streams: at most one bfloat16 ulp, where a float32 difference crosses a rounding
midpoint) and the coefficients to 1e-5 after 20 Sinkhorn rounds. Every VJP (the hand-written ones
of expand / collapse, the Sinkhorn backward kernel) against `jax.grad` of an independent form.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers import mhc
from pallas_kernels import mhc_fast
from tests.dsv41_jax.layers.test_mhc import ref_hc
from tests.pallas_kernels.test_mhc_site import KW, _close_coefficients, _inputs


def _within_bf16_ulp(got, want):
  g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
  ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(g), np.abs(w)))) - 7)
  assert (np.abs(g - w) <= ulp).all()
  assert (g != w).mean() < 0.01


def _einsum_expand(X, post, comb, F):
  """expand as the einsum over the stream axis (the former reference), for jax.grad."""
  mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(jnp.float32), X.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  out = post.astype(jnp.float32)[..., None] * F.astype(jnp.float32)[..., None, :]
  return (out + mixed).astype(X.dtype)


def _einsum_collapse(X, pre):
  y = jnp.einsum("...nd,...n->...d", X.astype(jnp.float32), pre.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)
  return y.astype(X.dtype)


def _vjp_all(f, args, seed=3):
  """Gradients of Σ w·f(args) for random w, w.r.t. every argument, float32."""
  rng = np.random.default_rng(seed)
  outs = jax.eval_shape(f, *args)
  outs = outs if isinstance(outs, tuple) else (outs,)
  ws = [jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in outs]

  def loss(*a):
    o = f(*a)
    o = o if isinstance(o, tuple) else (o,)
    return sum(jnp.sum(w * oi.astype(jnp.float32)) for w, oi in zip(ws, o))
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def _close_grads(got, want, names, rtol=2e-5):
  for name, g, w in zip(names, got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol,
                               atol=rtol * scale, err_msg=name)


def _ref_gates(z, n=4, iters=20, eps=1e-6):
  pre = jax.nn.sigmoid(z[..., :n]) + eps
  post = 2.0 * jax.nn.sigmoid(z[..., n:2 * n])
  comb = mhc.sinkhorn_project(z[..., 2 * n:].reshape(*z.shape[:-1], n, n), iters, eps)
  return jnp.concatenate([pre, post, comb.reshape(*z.shape[:-1], n * n)], -1)


def test_gates_kernel_matches_reference_float64_and_autodiff():
  rng = np.random.default_rng(0)
  z = jnp.asarray(3 * rng.standard_normal((3, 7, 24)), jnp.float32)   # 21 tokens: a padded tail
  static = (4, 20, 1e-6, 8, True)
  got = mhc_fast.gates(z, static)
  np.testing.assert_allclose(np.asarray(got), np.asarray(_ref_gates(z)), rtol=1e-5, atol=1e-6)
  # float64 restatement: ref_hc with fn = 0, so the gate logits are base (the token's z).
  for t in range(3):
    zt = np.asarray(z[1, t], np.float64)
    pre, post, comb = ref_hc(np.ones((1, 4, 8)), np.zeros((24, 32)), zt, np.ones(3))
    want = np.concatenate([pre[0], post[0], comb[0].reshape(-1)])
    np.testing.assert_allclose(np.asarray(got[1, t]), want, rtol=1e-5, atol=1e-6)
  _close_grads(_vjp_all(lambda z: mhc_fast.gates(z, static), (z,)),
               _vjp_all(_ref_gates, (z,)), ["z"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expand_and_collapse_forward_and_vjps(dtype):
  X, F, post, comb, pre, *_ = _inputs(1, lead=(2, 9), dtype=dtype)
  got, want = mhc.expand(X, post, comb, F), _einsum_expand(X, post, comb, F)
  assert got.dtype == want.dtype == dtype
  if dtype == jnp.float32:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
  else:
    _within_bf16_ulp(got, want)
  names = ["X", "post", "comb", "F"]
  _close_grads(_vjp_all(mhc.expand, (X, post, comb, F)),
               _vjp_all(_einsum_expand, (X, post, comb, F)), names)
  for p in (pre, pre[0, 0]):  # per token, and one [n] vector broadcast over tokens
    got, want = mhc.collapse(X, p), _einsum_collapse(X, p)
    assert got.dtype == want.dtype == dtype
    if dtype == jnp.float32:
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    else:
      _within_bf16_ulp(got, want)
    _close_grads(_vjp_all(mhc.collapse, (X, p)), _vjp_all(_einsum_collapse, (X, p)), ["X", "pre"])


def test_coefficients_match_float64():
  X, _, _, _, _, fn, base, scale, _ = _inputs(2, lead=(2, 5))
  got = mhc_fast.hc_coefficients(X, fn, base, scale, **KW)
  want = ref_hc(X, fn, base, scale, iters=KW["iters"], hc_eps=KW["hc_eps"],
                norm_eps=KW["norm_eps"])
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
  assert float(jnp.std(got[2])) > 0.05


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_site_matches_reference_forward_and_gradients(dtype):
  args = _inputs(4, lead=(2, 9), dtype=dtype)
  got, want = mhc_fast.hc_site(*args, **KW), mhc.hc_site(*args, **KW)
  for g, w in zip(got[:2], want[:2]):
    assert g.shape == w.shape and g.dtype == w.dtype == dtype
    if dtype == jnp.float32:
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-6)
    else:
      _within_bf16_ulp(g, w)
  _close_coefficients(got[2:], want[2:])
  if dtype == jnp.float32:
    kw = dict(KW, iters=5)
    names = ["X", "F", "post", "comb", "pre", "fn", "base", "scale", "norm_weight"]
    _close_grads(_vjp_all(lambda *a: mhc_fast.hc_site(*a, **kw), args),
                 _vjp_all(lambda *a: mhc.hc_site(*a, **kw), args), names)


def test_gates_kernels_lower_for_cuda():
  # Triton lowering on the CPU host: the backward's parity test once used `%` on a loop index,
  # which Triton's lowering rejects (AssertionError ('i32', 'i1'), seen on the H200).
  z = jnp.zeros((2, 64, 24), jnp.float32)
  fwd = lambda z: mhc_fast.gates(z, (4, 20, 1e-6, 16, False))
  bwd = lambda z, g: jax.vjp(fwd, z)[1](g)[0]
  for f, args in ((fwd, (z,)), (bwd, (z, jnp.ones((2, 64, 24), jnp.float32)))):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mhc_" in text
