"""pallas_kernels/mhc.py (interpret mode) against the ops' references (pallas_kernels.ops.mhc) and
float64; the ops' expand / collapse (broadcast multiply-adds, hand VJPs) against their einsum forms;
the dispatcher's rows `hc_coefficients` and `hc_site` reached from the model.

Forward: the same float32 formulas with sums in another order, so X' and x agree to float32
rounding (bfloat16 streams: at most one bfloat16 ulp, where a float32 difference crosses a rounding
midpoint) and the coefficients to 1e-5 after 20 Sinkhorn rounds. Every VJP (the hand-written ones
of expand / collapse, the recomputing Sinkhorn backward kernel) against `jax.grad` of an
independent form. The per-shard run on an 8-device mesh is tests/pallas_kernels/test_coverage.py's.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import model as M, testing
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import mhc
from pallas_kernels import dispatch
from pallas_kernels import mhc as mhc_kernel, mhc_rows
from tests.dsv41_jax.layers.test_mhc import ref_hc
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls

KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)
SITE = ("X", "F", "post", "comb", "pre", "fn", "base", "scale", "norm_weight")


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
  # The same float32 formula: only the summation order of the n·d-term mix and RMS differs,
  # carried by 20 Sinkhorn rounds to ~1e-6.
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _within_bf16_ulp(got, want):
  g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
  ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(g), np.abs(w)))) - 7)
  assert (np.abs(g - w) <= ulp).all()
  assert (g != w).mean() < 0.01


def close_site_outputs(got, want, dtype):
  """A site kernel's (X', x, pre', post', comb') against the reference's: X' in the streams' dtype
  (bfloat16: within one ulp), the sublayer input x in float32 (its caller casts it once) to float32
  rounding, the coefficients as `_close_coefficients`."""
  for g, w, dt in zip(got[:2], want[:2], (dtype, jnp.float32)):
    assert g.shape == w.shape and g.dtype == w.dtype == dt
    if dt == jnp.float32:
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-6)
    else:
      _within_bf16_ulp(g, w)
  _close_coefficients(got[2:], want[2:])


def _einsum_expand(X, post, comb, F):
  """expand as the einsum over the stream axis (the former reference), for jax.grad."""
  mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(jnp.float32), X.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  out = post.astype(jnp.float32)[..., None] * F.astype(jnp.float32)[..., None, :]
  return (out + mixed).astype(X.dtype)


def _einsum_collapse(X, pre):
  y = jnp.einsum("...nd,...n->...d", X.astype(jnp.float32), pre.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)
  return y                     # float32 whatever X's dtype: the sublayer norm reads it unrounded


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


# --- the gate kernels --------------------------------------------------------------------------

def test_gates_kernel_matches_reference_float64_and_autodiff():
  rng = np.random.default_rng(0)
  z = jnp.asarray(3 * rng.standard_normal((3, 7, 24)), jnp.float32)   # 21 tokens: a padded tail
  static = (4, 20, 1e-6, 8, True)
  got = mhc_kernel.gates(z, static)
  np.testing.assert_allclose(np.asarray(got), np.asarray(_ref_gates(z)), rtol=1e-5, atol=1e-6)
  # float64 restatement: ref_hc with fn = 0, so the gate logits are base (the token's z).
  for t in range(3):
    zt = np.asarray(z[1, t], np.float64)
    pre, post, comb = ref_hc(np.ones((1, 4, 8)), np.zeros((24, 32)), zt, np.ones(3))
    want = np.concatenate([pre[0], post[0], comb[0].reshape(-1)])
    np.testing.assert_allclose(np.asarray(got[1, t]), want, rtol=1e-5, atol=1e-6)
  _close_grads(_vjp_all(lambda z: mhc_kernel.gates(z, static), (z,)),
               _vjp_all(_ref_gates, (z,)), ["z"])


@pytest.mark.parametrize("iters", [1, 2, 3, 20])
def test_gates_backward_kernel_matches_autodiff_other_stream_count(iters):
  # n = 2 (the gate rows' padding groups differ from n = 4's): the backward against jax.vjp of the
  # reference gates, across the backward's segments of ⌊√steps⌋ steps: 1 iteration is 1 step,
  # 2 are 3 steps in segments of 1, 3 are 5 steps in segments of 2, 2, 1, and 20 are 39 steps in
  # six segments of 6 and a last of 3.
  n, rng = 2, np.random.default_rng(5)
  z = jnp.asarray(3 * rng.standard_normal((2, 9, (2 + n) * n)), jnp.float32)
  g = jnp.asarray(rng.standard_normal(z.shape), jnp.float32)
  want = jax.vjp(lambda z: _ref_gates(z, n=n, iters=iters), z)[1](g)[0]
  got = mhc_kernel.gates_vjp(z, g, n=n, iters=iters, hc_eps=1e-6, block_tokens=8, interpret=True)
  # Same float32 operations in the same order per step; 39 steps accumulate ~1e-6 relative.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_gates_kernels_lower_for_cuda():
  # Triton lowering on the CPU host: the backward's parity test once used `%` on a loop index,
  # which Triton's lowering rejects (AssertionError ('i32', 'i1'), seen on the H200).
  z = jnp.zeros((2, 64, 24), jnp.float32)
  fwd = lambda z: mhc_kernel.gates(z, (4, 20, 1e-6, 16, False))  # noqa: E731
  bwd = lambda z, g: jax.vjp(fwd, z)[1](g)[0]  # noqa: E731
  for f, args in ((fwd, (z,)), (bwd, (z, jnp.ones((2, 64, 24), jnp.float32)))):
    lowered = lower_for_cuda(f, *args)
    assert "mhc_gates" in lowered.as_text() and triton_calls(lowered) == 1


# --- the ops' expand and collapse --------------------------------------------------------------

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
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    _close_grads(_vjp_all(mhc.collapse, (X, p)), _vjp_all(_einsum_collapse, (X, p)), ["X", "pre"])


def test_mix_of_bfloat16_streams_against_float64():
  """Bfloat16 streams (design §3.5): the mix x̂ · fnᵀ from one bfloat16 product over x̂ as stored
  (fn as three exact bfloat16 terms) is as close to float64 as the float32 product of float32
  streams; the product's x̂ cotangent within one bfloat16 ulp of the rounded float64 value, fn's
  as close as a float32 sum; one product forward, two backward, every operand bfloat16 (x̂ is
  never copied to float32 for them)."""
  from pallas_kernels.ops import mhc as ops_mhc
  rng = np.random.default_rng(11)
  X = jnp.asarray(rng.standard_normal((2, 7, 4, 64)), jnp.bfloat16)
  fn = jnp.asarray(rng.standard_normal((24, 256)) * 0.05, jnp.float32)
  g = jnp.asarray(rng.standard_normal((2, 7, 24)), jnp.float32)
  x64, f64, g64 = (np.asarray(a, np.float64) for a in (X.reshape(2, 7, 256), fn, g))
  rho = 1 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-20)
  mix = lambda X, fn: ops_mhc.hc_mix(X, fn, 1e-20)  # noqa: E731
  want = (x64 @ f64.T) * rho
  np.testing.assert_allclose(np.asarray(mix(X, fn), np.float64), want, rtol=0,
                             atol=1e-6 * np.abs(want).max())
  # The product's own VJP (hc_mix adds the mean square's cotangent to x̂'s in bfloat16, as
  # autodiff sums every cotangent of a bfloat16 value).
  x = X.reshape(2, 7, 256)
  dx, dfn = jax.vjp(ops_mhc._mix_bf16, x, fn)[1](g)
  assert dx.dtype == jnp.bfloat16 and dfn.dtype == jnp.float32
  _within_bf16_ulp(dx, jnp.asarray(g64 @ f64, jnp.bfloat16))
  dfn_want = np.einsum("btm,btk->mk", g64, x64)
  np.testing.assert_allclose(np.asarray(dfn), dfn_want, rtol=0, atol=1e-6 * np.abs(dfn_want).max())
  fwd = jax.make_jaxpr(mix)(X, fn).jaxpr
  bwd = jax.make_jaxpr(lambda X, fn, g: jax.vjp(mix, X, fn)[1](g))(X, fn, g).jaxpr
  dots = testing.jaxpr_eqns(fwd, "dot_general") + testing.jaxpr_eqns(bwd, "dot_general")
  assert len(testing.jaxpr_eqns(fwd, "dot_general")) == 1 and len(dots) == 1 + 3
  for e in dots:   # every product's operands bfloat16 (the backward's own forward included)
    assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e


def test_expand_vjp_materialises_its_coefficient_sums():
  """The expand VJP's n + 1 row sums (post's and comb's cotangents) leave through one
  optimization barrier, so that XLA cannot fuse a sum over d into the gates' padded input as a
  loop fusion (what it did on the H200: ops.mhc._expand_bwd). Its values are the test above's."""
  X, F, post, comb, *_ = _inputs(1, lead=(2, 9))
  n = X.shape[-2]
  vjp = lambda *a: jax.vjp(mhc.expand, *a[:4])[1](a[4])  # noqa: E731
  barriers = testing.jaxpr_eqns(jax.make_jaxpr(vjp)(X, post, comb, F, X).jaxpr, "optimization_barrier")
  assert len(barriers) == 1
  assert [v.aval.shape for v in barriers[0].invars] == [(2, 9, n)] * (n + 1)


# --- the ops' kernels --------------------------------------------------------------------------

def test_coefficients_match_float64_and_gradients_the_reference():
  X, _, _, _, _, fn, base, scale, _ = _inputs(2, lead=(2, 5))
  got = mhc_kernel.hc_coefficients(X, fn, base, scale, **KW)
  want = ref_hc(X, fn, base, scale, iters=KW["iters"], hc_eps=KW["hc_eps"],
                norm_eps=KW["norm_eps"])
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
  assert float(jnp.std(got[2])) > 0.05
  kw = dict(KW, iters=5)
  _close_grads(_vjp_all(lambda *a: mhc_kernel.hc_coefficients(*a, **kw), (X, fn, base, scale)),
               _vjp_all(lambda *a: mhc.hc_coefficients(*a, **kw), (X, fn, base, scale)),
               ["X", "fn", "base", "scale"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_site_matches_reference_forward_and_gradients(dtype):
  args = _inputs(4, lead=(2, 9), dtype=dtype)
  close_site_outputs(mhc_kernel.hc_site(*args, **KW), mhc.hc_site(*args, **KW), dtype)
  if dtype == jnp.float32:
    kw = dict(KW, iters=5)
    _close_grads(_vjp_all(lambda *a: mhc_kernel.hc_site(*a, **kw), args),
                 _vjp_all(lambda *a: mhc.hc_site(*a, **kw), args), SITE)


@pytest.mark.parametrize("site", [mhc.hc_site, mhc_kernel.hc_site])
def test_layer_remat_keeps_the_mix_and_gates(site):
  """Under the model's remat policy a site's gradient program reads the streams for the mix as
  often as without remat: the float32 mix GEMM once forward (plus its two backward products), the
  mean square over x̂ once, and (kernel) the gate kernel once forward; their outputs are named
  `ops.mhc.MIX` (without the names: 4 products, 2 mean squares, 2 gate kernels). The kernel's
  coefficients take the op's mix (no `mhc_mix` kernel: slower in the step, pallas_kernels/mhc.py)."""
  args = _inputs(5, lead=(2, 9))
  n_d = args[0].shape[-2] * args[0].shape[-1]
  kw = dict(KW, iters=5)

  def loss(*a):
    return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in site(*a, **kw))

  def counts(f):
    g = jax.make_jaxpr(jax.grad(f, argnums=(0, 5)))(*args).jaxpr
    mean_square = lambda e: e.invars[0].aval.shape[-1] == n_d  # noqa: E731 (x̂ [.., n·d])
    kernel = lambda name: lambda e: f"'{name}'" in str(e.params)  # noqa: E731
    return (len(testing.jaxpr_eqns(g, "dot_general")), len(testing.jaxpr_eqns(g, "reduce_sum", mean_square)),
            len(testing.jaxpr_eqns(g, "pallas_call", kernel("mhc_gates"))),
            len(testing.jaxpr_eqns(g, "pallas_call", kernel("mhc_mix"))))

  plain = counts(loss)
  assert plain == (3, 1, int(site is mhc_kernel.hc_site), 0)
  assert counts(jax.checkpoint(loss, prevent_cse=False, policy=M.remat_policy)) == plain


# --- the dispatcher's rows and the model -------------------------------------------------------

def test_policies_pick_the_kernels_fall_back_and_refuse(caplog, monkeypatch):
  # The decision is logged once per process: forget earlier tests' notices (order-independent).
  from pallas_kernels import notices
  notices._NOTED.clear()
  args = _inputs(6, lead=(1, 4))
  for op, fn, ref, a in (("hc_site", mhc_rows.hc_site, mhc.hc_site, args),
                         ("hc_coefficients", mhc_kernel.hc_coefficients, mhc.hc_coefficients,
                          (args[0], *args[5:8]))):
    assert dispatch.choose(op, "kernel", *a, **KW)[1].__wrapped__ is fn
    assert dispatch.choose(op, "reference", *a, **KW)[1] is ref
    # "auto" on the CPU: the reference, bit for bit, with one log line per op and decision.
    with caplog.at_level(logging.INFO):
      for _ in range(2):
        path, impl = dispatch.choose(op, "auto", *a, **KW)
    assert path == f"pallas_kernels.ops.mhc:{op}" and impl is ref
    assert sum(f"op {op}: policy 'auto' runs the reference" in r.message and "GPU" in r.message
               for r in caplog.records) == 1
    for g, w in zip(dispatch.call(op, *a, policy="auto", **KW), ref(*a, **KW)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # On a GPU "auto" takes the kernel; three streams are not Triton's power-of-two blocks, so
  # "auto" runs the reference and "kernel" is one error naming the reason.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert dispatch.choose("hc_site", "auto", *args, **KW)[0] == "pallas_kernels.mhc_rows:hc_site"
  three = _inputs(6, lead=(1, 4), n=3)
  assert dispatch.choose("hc_site", "auto", *three, **KW)[0] == "pallas_kernels.ops.mhc:hc_site"
  with pytest.raises(dispatch.PolicyError,
                     match=r"op hc_coefficients: policy 'kernel' .*hc_mult 3: the gate rows "
                           r"\(24 columns\) are not a power of two"):
    dispatch.choose("hc_coefficients", "kernel", three[0], *three[5:8], **KW)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.raises(dispatch.PolicyError, match="op hc_site: policy 'kernel' .*'tpu'"):
    dispatch.choose("hc_site", "kernel", *args, **KW)


def test_model_site_runs_the_kernels_under_the_kernel_policy():
  # MHCSite's two methods under ops "kernel" against the same site under "reference".
  cfg = ModelConfig(hidden_size=32, hc_mult=4, hc_init_fn_std=0.05)
  ref = mhc.MHCSite(cfg.replace(ops={"hc_coefficients": "reference", "hc_site": "reference"}),
                    nnx.Rngs(0))
  kern = mhc.MHCSite(cfg.replace(ops={"hc_coefficients": "kernel", "hc_site": "kernel"}),
                     nnx.Rngs(0))
  X, F, post, comb, pre, _, _, _, w = _inputs(3, lead=(2, 4))
  assert "mhc_gates" in str(jax.make_jaxpr(lambda x: nnx.merge(*nnx.split(kern))(x))(X))
  _close_coefficients(nnx.jit(lambda s, x: s(x))(kern, X), nnx.jit(lambda s, x: s(x))(ref, X))
  site = lambda s, *a: s.site(*a)  # noqa: E731
  got = nnx.jit(site)(kern, X, F, post, comb, pre, w)
  want = nnx.jit(site)(ref, X, F, post, comb, pre, w)
  for g, v in zip(got[:2], want[:2]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=2e-6, atol=1e-6)
  _close_coefficients(got[2:], want[2:])
