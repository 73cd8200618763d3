"""dsv41_jax/layers/mhc.py (docs/design.md §3.2–3.4) against a float64 numpy restatement of the spec."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import mhc
from dsv41_jax.layers.norm import RMSNorm, rms_norm

N, D = 4, 32
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def ref_hc(X, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS):
  """§3.2 line by line in float64."""
  X, fn, base, scale = (np.asarray(a, np.float64) for a in (X, fn, base, scale))
  *lead, n, d = X.shape
  x = X.reshape(*lead, n * d)
  rho = 1.0 / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + norm_eps)
  mix = (x @ fn.T) * rho
  pre = _sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
  post = 2 * _sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
  c0 = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*lead, n, n)
  e = np.exp(c0 - c0.max(-1, keepdims=True))
  comb = e / e.sum(-1, keepdims=True) + hc_eps
  comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
  for _ in range(iters - 1):
    comb = comb / (comb.sum(-1, keepdims=True) + hc_eps)
    comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
  return pre, post, comb


def _inputs(seed, B=2, T=5, fn_std=0.3):
  """Random streams and parameters that make every coefficient strongly token dependent."""
  rng = np.random.default_rng(seed)
  X = rng.standard_normal((B, T, N, D)).astype(np.float32) * rng.uniform(0.1, 10, (B, T, 1, 1))
  fn = (fn_std * rng.standard_normal(((2 + N) * N, N * D))).astype(np.float32)
  base = rng.standard_normal(((2 + N) * N,)).astype(np.float32)
  scale = rng.uniform(0.5, 1.5, (3,)).astype(np.float32)
  return X.astype(np.float32), fn, base, scale


def _coeffs(X, fn, base, scale):
  return mhc.hc_coefficients(jnp.asarray(X), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale),
                             iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)


def test_coefficients_match_float64_reference():
  X, fn, base, scale = _inputs(0)
  got = _coeffs(X, fn, base, scale)
  want = ref_hc(X, fn, base, scale)
  # float32 arithmetic vs float64: the mix is a 128-term dot, then sigmoid / 20 Sinkhorn rounds.
  for name, g, w in zip(("pre", "post", "comb"), got, want):
    assert g.dtype == jnp.float32 and g.shape == w.shape, name
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6, err_msg=name)
  assert np.std(want[2]) > 0.05  # comb is far from uniform and from the identity


def test_coefficients_bfloat16_streams_are_promoted():
  X, fn, base, scale = _inputs(1)
  Xb = jnp.asarray(X, jnp.bfloat16)
  got = _coeffs(Xb, fn, base, scale)
  want = ref_hc(np.asarray(Xb, np.float32), fn, base, scale)
  for g, w in zip(got, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6)


def test_comb_is_doubly_stochastic_to_sinkhorn_tolerance():
  rng = np.random.default_rng(2)
  logits = (rng.standard_normal((256, N, N)) * rng.choice([1.0, 3.0], (256, 1, 1))).astype(np.float32)
  comb = np.asarray(mhc.sinkhorn_project(jnp.asarray(logits), ITERS, HC_EPS))
  ref_comb = _ref_sinkhorn(logits.astype(np.float64))
  np.testing.assert_allclose(comb, ref_comb, rtol=1e-5, atol=1e-7)
  assert (comb > 0).all()
  col_err = np.abs(comb.sum(-2) - 1)
  row_err = np.abs(comb.sum(-1) - 1)
  # The last step normalises columns: they sum to 1 up to eps (1e-6) and float32 rounding.
  assert col_err.max() < 3e-6, col_err.max()
  # Rows carry what 20 alternations leave unconverged. Measured on 4096 draws: logits of std 1 give
  # row errors ≈ 1e-6 (median) and 9e-5 (max); std 3 gives 1e-4 (median), 2.4e-2 (99th pct),
  # 4.7e-2 (max). The float64 reference has the same residuals, so float32 adds nothing.
  ref_row_err = np.abs(ref_comb.sum(-1) - 1)
  assert np.abs(row_err - ref_row_err).max() < 3e-6
  assert np.median(row_err) < 1e-4 and row_err.max() < 5e-2, (np.median(row_err), row_err.max())


def _ref_sinkhorn(c0, iters=ITERS, eps=HC_EPS):
  e = np.exp(c0 - c0.max(-1, keepdims=True))
  comb = e / e.sum(-1, keepdims=True) + eps
  comb = comb / (comb.sum(-2, keepdims=True) + eps)
  for _ in range(iters - 1):
    comb = comb / (comb.sum(-1, keepdims=True) + eps)
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
  return comb


def test_expand_uses_comb_transposed():
  rng = np.random.default_rng(3)
  X = rng.standard_normal((2, 3, N, D)).astype(np.float32)
  post = rng.uniform(0, 2, (2, 3, N)).astype(np.float32)
  comb = rng.uniform(0, 1, (2, 3, N, N)).astype(np.float32)  # far from symmetric
  F = rng.standard_normal((2, 3, D)).astype(np.float32)
  got = np.asarray(mhc.expand(jnp.asarray(X), jnp.asarray(post), jnp.asarray(comb), jnp.asarray(F)))
  want = np.zeros((2, 3, N, D))
  for k in range(N):  # X'_k = post_k F + Σ_j comb[j, k] X_j, as a loop
    want[:, :, k] = post[:, :, k, None] * F
    for j in range(N):
      want[:, :, k] += comb[:, :, j, k, None] * X[:, :, j]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  untransposed = np.einsum("btkj,btjd->btkd", comb, X) + post[..., None] * F[:, :, None]
  assert np.abs(untransposed - want).max() > 0.1  # the test separates comb from combᵀ


def test_collapse_weighted_sum_and_initial_pre_exact():
  rng = np.random.default_rng(4)
  X = rng.standard_normal((2, 3, N, D)).astype(np.float32)
  pre = rng.uniform(0, 1, (2, 3, N)).astype(np.float32)
  got = np.asarray(mhc.collapse(jnp.asarray(X), jnp.asarray(pre)))
  np.testing.assert_allclose(got, np.einsum("btnd,btn->btd", X.astype(np.float64), pre),
                             rtol=1e-6, atol=1e-6)
  for dtype in (jnp.float32, jnp.bfloat16):
    h = jnp.asarray(rng.standard_normal((2, 3, D)), dtype)
    X0 = jnp.broadcast_to(h[:, :, None, :], (2, 3, N, D))  # X⁰: the embedding on every stream
    y = mhc.collapse(X0, mhc.initial_pre(N))
    assert y.dtype == jnp.float32          # the norm after it reads unrounded values
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(h, np.float32))


def _cfg(**kw):
  return ModelConfig(hidden_size=D, hc_mult=N, **kw)


def test_site_parameters_and_init():
  site = mhc.MHCSite(_cfg(hc_init_fn_std=1e-3, hc_init_pre_base=0.25, hc_init_res_diag=6.0),
                     nnx.Rngs(0))
  assert site.fn.shape == ((2 + N) * N, N * D) and site.base.shape == ((2 + N) * N,)
  assert site.scale.shape == (3,)
  assert sharding.param_axes(site.fn) == ("hc_mix", "embed")
  assert sharding.param_axes(site.base) == ("hc_mix",)
  assert sharding.param_axes(site.scale) == ("hc",)
  assert all(p.dtype == jnp.float32 for p in (site.fn, site.base, site.scale))
  np.testing.assert_allclose(np.std(np.asarray(site.fn[...])), 1e-3, rtol=0.05)
  base = np.asarray(site.base[...])
  np.testing.assert_array_equal(base[:N], 0.25)
  np.testing.assert_array_equal(base[N:2 * N], 0.0)
  np.testing.assert_array_equal(base[2 * N:].reshape(N, N), 6.0 * np.eye(N))
  np.testing.assert_array_equal(np.asarray(site.scale[...]), 1.0)


def test_site_call_matches_reference_and_starts_near_identity():
  site = mhc.MHCSite(_cfg(), nnx.Rngs(1))
  X, *_ = _inputs(5)
  pre, post, comb = site(jnp.asarray(X))
  want = ref_hc(X, site.fn[...], site.base[...], site.scale[...], iters=site.iters,
                hc_eps=site.hc_eps, norm_eps=site.norm_eps)
  for g, w in zip((pre, post, comb), want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6)
  # §3.4 intent: pre ≈ sigmoid(0) = 0.5, post ≈ 1, comb ≈ I (diagonal e^6/(e^6+3) before Sinkhorn).
  np.testing.assert_allclose(np.asarray(pre), 0.5, atol=0.02)
  np.testing.assert_allclose(np.asarray(post), 1.0, atol=0.04)
  assert (np.diagonal(np.asarray(comb), axis1=-2, axis2=-1) > 0.98).all()


def test_rms_norm_against_float64():
  rng = np.random.default_rng(6)
  x = (rng.standard_normal((3, 7, D)) * rng.uniform(0.01, 100, (3, 7, 1))).astype(np.float32)
  w = rng.standard_normal((D,)).astype(np.float32)
  want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6) * w
  np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), want,
                             rtol=2e-6, atol=1e-6)
  norm = RMSNorm(D, 1e-20, nnx.Rngs(0))
  assert sharding.param_axes(norm.scale) == ("norm",)
  np.testing.assert_array_equal(np.asarray(norm.scale[...]), 1.0)
  xb = jnp.asarray(x, jnp.bfloat16)
  y = norm(xb)
  assert y.dtype == jnp.bfloat16
  xb64 = np.asarray(xb, np.float64)
  np.testing.assert_allclose(np.asarray(y, np.float32),
                             xb64 / np.sqrt(np.mean(xb64 ** 2, -1, keepdims=True)), rtol=8e-3)
