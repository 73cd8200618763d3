"""pallas_kernels/mhc_site.py (interpret mode) against the op pallas_kernels.ops.mhc.hc_site."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv41_jax import sharding
from dsv41_jax.layers import mhc
from pallas_kernels import dispatch, mhc_site

KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)


def _inputs(seed, lead=(2, 9), n=4, d=32, dtype=jnp.float32):
  """Streams at per-token scales 0.1..10, a sublayer output, the previous site's coefficients
  (pre/post positive, comb a Sinkhorn projection of random logits) and this site's parameters."""
  rng = np.random.default_rng(seed)
  X = rng.standard_normal((*lead, n, d)) * rng.uniform(0.1, 10, (*lead, 1, 1))
  F = rng.standard_normal((*lead, d)) * rng.uniform(0.1, 10, (*lead, 1))
  pre = rng.uniform(0.05, 1.0, (*lead, n))
  post = rng.uniform(0.0, 2.0, (*lead, n))
  comb = mhc.sinkhorn_project(jnp.asarray(2 * rng.standard_normal((*lead, n, n)), jnp.float32),
                              20, 1e-6)
  fn = 0.2 * rng.standard_normal(((2 + n) * n, n * d))
  base = rng.standard_normal(((2 + n) * n,))
  scale = rng.uniform(0.5, 1.5, (3,))
  w = rng.uniform(0.5, 1.5, (d,))
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  return (jnp.asarray(X, dtype), jnp.asarray(F, dtype), f32(post), f32(comb), f32(pre), f32(fn),
          f32(base), f32(scale), f32(w))


def _close_coefficients(got, want):
  # The same float32 formula as the coefficient kernel (tests/pallas_kernels/test_mhc.py): only the
  # summation order of the n·d-term mix and RMS differs, carried by 20 Sinkhorn rounds to ~1e-6.
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_tokens, block_d", [(8, 16), (16, 32)])
def test_forward_matches_reference_float32(block_tokens, block_d):
  # 18 tokens: a padded token tail for both block sizes; block_d 16 loops over 2 chunks of d.
  args = _inputs(block_tokens)
  got = mhc_site.hc_site_forward(*args, **KW, block_tokens=block_tokens, block_d=block_d,
                                 interpret=True)
  want = mhc.hc_site(*args, **KW)
  # X' and x: float32 sums of n + 1 products in another order (≤ a few ulps), then the norm's
  # rsqrt over a 32-term sum: relative 2e-6 covers it; the values are O(0.1..100).
  for g, w in zip(got[:2], want[:2]):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-6)
  _close_coefficients(got[2:], want[2:])
  assert float(jnp.std(got[4])) > 0.05  # comb is token dependent


def test_forward_bfloat16_streams():
  args = _inputs(3, lead=(3, 8), dtype=jnp.bfloat16)
  got = mhc_site.hc_site_forward(*args, **KW, block_tokens=8, block_d=16, interpret=True)
  want = mhc.hc_site(*args, **KW)
  for g, w in zip(got[:2], want[:2]):
    assert g.dtype == jnp.bfloat16
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    # The float32 value before the bfloat16 rounding differs by ulps, which flips a rounding only
    # when it sits on a bfloat16 midpoint: at most one bfloat16 ulp, in few elements.
    diff = np.abs(g - w)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(g), np.abs(w)))) - 7)  # bfloat16 spacing
    assert (diff <= ulp).all()
    assert (diff > 0).mean() < 0.01
  _close_coefficients(got[2:], want[2:])


def test_sinkhorn_backward_kernel_matches_autodiff():
  # The recomputing backward against jax.vjp of the reference gates with 20 iterations.
  n, rng = 4, np.random.default_rng(5)
  z = jnp.asarray(3 * rng.standard_normal((2, 9, (2 + n) * n)), jnp.float32)
  g = jnp.asarray(rng.standard_normal(z.shape), jnp.float32)

  def gates(z):
    pre = jax.nn.sigmoid(z[..., :n]) + 1e-6
    post = 2.0 * jax.nn.sigmoid(z[..., n:2 * n])
    comb = mhc.sinkhorn_project(z[..., 2 * n:].reshape(*z.shape[:-1], n, n), 20, 1e-6)
    return jnp.concatenate([pre, post, comb.reshape(*z.shape[:-1], n * n)], -1)

  want = jax.vjp(gates, z)[1](g)[0]
  got = mhc_site.sinkhorn_gates_vjp(z, g, n=n, iters=20, hc_eps=1e-6, block_tokens=8,
                                    interpret=True)
  # Same float32 operations in the same order per step; 39 steps accumulate ~1e-6 relative.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _grads(site, args, kw):
  rng = np.random.default_rng(11)
  outs = jax.eval_shape(lambda *a: site(*a, **kw), *args)
  w = [jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in outs]

  def loss(*a):
    return sum(jnp.sum(wi * oi.astype(jnp.float32)) for wi, oi in zip(w, site(*a, **kw)))
  return jax.jit(jax.grad(loss, argnums=tuple(range(9))))(*args)


def test_gradients_match_reference():
  kw = dict(iters=3, hc_eps=1e-6, norm_eps=1e-20)  # the backward is the same code for any iters
  args = _inputs(7, lead=(1, 8))
  kern = dispatch.choose("hc_site", "kernel", *args, **kw)[1]
  assert kern.__wrapped__ is mhc_site.hc_site
  assert dispatch.choose("hc_site", "reference", *args, **kw)[1] is mhc.hc_site
  names = ["X", "F", "post", "comb", "pre", "fn", "base", "scale", "norm_weight"]
  for name, gk, gr in zip(names, _grads(kern, args, kw), _grads(mhc.hc_site, args, kw)):
    assert gk.shape == gr.shape, name
    # The same float32 VJP except the gates' (recomputed Sinkhorn) and the kernel-free mix: the
    # gradients agree to float32 rounding of sums over ≤ 18 tokens × 128 channels.
    np.testing.assert_allclose(np.asarray(gk), np.asarray(gr), rtol=2e-5,
                               atol=2e-5 * float(jnp.max(jnp.abs(gr))), err_msg=name)


def test_runs_per_batch_shard_on_a_mesh():
  # 8 CPU devices, batch split over data × fsdp: the op's kernel (run per shard by the dispatcher)
  # equals the unsharded kernel, forward and gradients, and the fake quant runs per shard too.
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  kw = dict(iters=3, hc_eps=1e-6, norm_eps=1e-20)
  site = lambda *a, **k: dispatch.call("hc_site", *a, policy="kernel", **k)  # noqa: E731
  args = _inputs(9, lead=(8, 2))
  want_fwd = mhc_site.hc_site(*args, **kw)
  want_grad = _grads(mhc_site.hc_site, args, kw)
  batch = NamedSharding(mesh, P(("data", "fsdp")))
  with jax.set_mesh(mesh):
    sharded = [jax.device_put(a, batch) if i < 5 else a for i, a in enumerate(args)]
    got_fwd = jax.jit(lambda *a: site(*a, **kw))(*sharded)
    got_grad = _grads(site, sharded, kw)
    x = jax.device_put(args[0].reshape(8, -1), batch)
    q = jax.jit(lambda v: dispatch.call("fake_quant_fp8_swa", v, policy="kernel"))(x)
    assert "shard_map" in str(jax.make_jaxpr(lambda *a: site(*a, **kw))(*sharded))
  for g, w in zip(got_fwd, want_fwd):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
  for g, w in zip(got_grad, want_grad):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
  assert got_fwd[0].sharding.spec[0] == ("data", "fsdp")
  from dsv41_jax import quant
  np.testing.assert_array_equal(np.asarray(q), np.asarray(quant.fp8_swa(args[0].reshape(8, -1))))
