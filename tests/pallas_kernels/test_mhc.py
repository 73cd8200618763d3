"""pallas_kernels/mhc.py (interpret mode) against the op pallas_kernels.ops.mhc.hc_coefficients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import mhc
from pallas_kernels import dispatch
from pallas_kernels import mhc as mhc_kernel

N, D = 4, 64
KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)


def _inputs(seed, lead=(2, 9), n=N, d=D):
  rng = np.random.default_rng(seed)
  X = rng.standard_normal((*lead, n, d)) * rng.uniform(0.1, 10, (*lead, 1, 1))
  fn = 0.2 * rng.standard_normal(((2 + n) * n, n * d))
  base = rng.standard_normal(((2 + n) * n,))
  scale = rng.uniform(0.5, 1.5, (3,))
  return tuple(jnp.asarray(a, jnp.float32) for a in (X, fn, base, scale))


def _close(got, want):
  # Same float32 formula; only the summation order of the 256-term mix (chunked dot vs XLA dot)
  # and of the RMS differs, which 20 Sinkhorn rounds carry into comb at the 1e-6 level.
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_tokens, block_k", [(8, 64), (16, 256)])
def test_kernel_matches_model_reference(block_tokens, block_k):
  # 18 tokens: the token grid has a padded tail for both block sizes; block_k 64 loops 4 chunks.
  X, fn, base, scale = _inputs(block_tokens)
  got = mhc_kernel.hc_coefficients_pallas(X, fn, base, scale, **KW, block_tokens=block_tokens,
                                          block_k=block_k, interpret=True)
  _close(got, mhc.hc_coefficients(X, fn, base, scale, **KW))
  assert float(jnp.std(got[2])) > 0.05  # comb is token dependent, not near a constant


def test_kernel_bfloat16_streams_and_other_stream_count():
  X, fn, base, scale = _inputs(1, lead=(3, 5), n=2, d=32)  # n = 2: groups padded 4 -> 4
  Xb = X.astype(jnp.bfloat16)
  _close(mhc_kernel.hc_coefficients_pallas(Xb, fn, base, scale, **KW, block_tokens=8,
                                           interpret=True),
         mhc.hc_coefficients(Xb, fn, base, scale, **KW))


def test_switch_and_gradients_follow_reference():
  # The backward is the reference VJP whatever the iteration count: 3 rounds keep compiles short.
  kw = dict(iters=3, hc_eps=1e-6, norm_eps=1e-20)
  X, fn, base, scale = _inputs(2, lead=(1, 8))
  assert dispatch.choose("hc_coefficients", "reference", X, fn, base, scale, **kw)[1] is (
      mhc.hc_coefficients)
  kern = dispatch.choose("hc_coefficients", "kernel", X, fn, base, scale, **kw)[1]
  assert kern.__wrapped__ is mhc_kernel.hc_coefficients
  w = [jnp.asarray(np.random.default_rng(i).standard_normal(o.shape), jnp.float32)
       for i, o in enumerate(mhc.hc_coefficients(X, fn, base, scale, **kw))]

  def loss(f):
    return lambda *a: sum(jnp.sum(wi * oi) for wi, oi in zip(w, f(*a, **kw)))

  g_kernel = jax.jit(jax.grad(loss(kern), argnums=(0, 1, 2, 3)))(X, fn, base, scale)
  g_ref = jax.jit(jax.grad(loss(mhc.hc_coefficients), argnums=(0, 1, 2, 3)))(X, fn, base, scale)
  for gk, gr in zip(g_kernel, g_ref):
    np.testing.assert_allclose(np.asarray(gk), np.asarray(gr), rtol=1e-6, atol=1e-7)


def test_site_with_pallas_kernels_matches_xla():
  cfg = ModelConfig(hidden_size=D, hc_mult=N, hc_init_fn_std=0.05)
  site_x = mhc.MHCSite(cfg, nnx.Rngs(0))
  site_p = mhc.MHCSite(cfg.replace(ops={"hc_coefficients": "kernel"}), nnx.Rngs(0))
  X = _inputs(3, lead=(2, 4))[0]
  _close(nnx.jit(lambda s, x: s(x))(site_p, X), nnx.jit(lambda s, x: s(x))(site_x, X))
