"""pallas_kernels/mhc_site.py (the fused site's Triton kernels, interpreted) against the op's
reference (`pallas_kernels.ops.mhc.hc_site`), float64 and autodiff; its lowering for CUDA.

Shapes: 2 × 24 tokens in blocks of 32 (a padded tail), d = 128 in chunks of 64 (two chunks per
pass), n = 4 (and 2 for the forward). Forward: the op's float32 formulas with sums in another
order, so X' agrees to float32 rounding or within one bfloat16 ulp, x and the mix to float32
rounding, the coefficients to 1e-5 after 20 Sinkhorn rounds. Gradients: float32 streams against
`jax.grad` of the op; bfloat16 streams against the op restated with its X' cotangents summed in
float32 (the kernel's arithmetic; the op rounds each to bfloat16, see
`test_gradients_of_bfloat16_streams`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import model as M, testing
from pallas_kernels import mhc_site
from pallas_kernels.ops import mhc as ops
from pallas_kernels.ops.norm import rms_norm
from tests.dsv41_jax.layers.test_mhc import ref_hc
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls
from tests.pallas_kernels.test_mhc import (KW, SITE, _close_coefficients, _close_grads, _inputs,
                                           _vjp_all, _within_bf16_ulp)

LEAD, D = (2, 24), 128
BLOCKS = dict(block_tokens=32, block_d=64)


def _fused(*a, **kw):
  return mhc_site.hc_site(*a, **dict(KW, **BLOCKS, **kw))


def _op(*a, **kw):
  return ops.hc_site(*a, **dict(KW, **kw))


@pytest.mark.parametrize("dtype,n", [(jnp.float32, 4), (jnp.bfloat16, 4), (jnp.float32, 2)])
def test_forward_matches_reference_and_float64(dtype, n):
  args = _inputs(7, lead=LEAD, n=n, d=D, dtype=dtype)
  got, want = jax.jit(_fused)(*args), jax.jit(_op)(*args)
  for g, w, dt in zip(got[:2], want[:2], (dtype, jnp.float32)):
    assert g.shape == w.shape and g.dtype == w.dtype == dt
  # X': the op's float32 multiply-adds in its order (a compiler may contract one into an FMA
  # in one program and not the other: float32 rounding, or one bfloat16 ulp once rounded).
  if dtype == jnp.bfloat16:
    _within_bf16_ulp(got[0], want[0])
  else:
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-6, atol=1e-6)
  _close_coefficients(got[2:], want[2:])

  # float64: X' from the inputs; x and the coefficients from X' as stored.
  X, F, post, comb, pre, fn, base, scale, w = (np.asarray(a, np.float64) for a in args)
  Xn = post[..., :, None] * F[..., None, :] + np.einsum("...jk,...jd->...kd", comb, X)
  Xg = np.asarray(got[0], np.float64)
  if dtype == jnp.bfloat16:   # the float32 sum rounded once: within one bfloat16 ulp
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(Xg), np.abs(Xn)))) - 7)
    assert (np.abs(Xg - Xn) <= ulp).all()
  else:
    np.testing.assert_allclose(Xg, Xn, rtol=0, atol=4e-7 * np.abs(Xn).max())
  c = np.einsum("...nd,...n->...d", Xg, pre)
  x = c / np.sqrt(np.mean(c ** 2, -1, keepdims=True) + KW["norm_eps"]) * w
  np.testing.assert_allclose(np.asarray(got[1], np.float64), x, rtol=2e-6, atol=1e-6)
  for g, v in zip(got[2:], ref_hc(Xg, fn, base, scale, iters=KW["iters"], hc_eps=KW["hc_eps"],
                                  norm_eps=KW["norm_eps"])):
    np.testing.assert_allclose(np.asarray(g), v, rtol=1e-5, atol=1e-6)
  assert float(jnp.std(got[4])) > 0.05      # the coefficients are token dependent


def test_gradients_of_float32_streams():
  args = _inputs(8, lead=LEAD, d=D)
  _close_grads(_vjp_all(_fused, args), _vjp_all(_op, args), SITE)


@jax.custom_vjp
def _stored_bf16(a):
  """a rounded to bfloat16, kept float32; the cotangent passes unrounded."""
  return a.astype(jnp.bfloat16).astype(jnp.float32)


_stored_bf16.defvjp(lambda a: (_stored_bf16(a), None), lambda _, g: (g,))


def _op_float32_cotangents(X, F, post, comb, pre, fn, base, scale, w):
  """The op with bfloat16 X' (the same values) whose cotangents are summed in float32."""
  Xn = _stored_bf16(ops._expand_f32(X, post, comb, F))
  coefficients = ops.hc_coefficients(Xn, fn, base, scale, **KW)
  x = rms_norm(ops.collapse(Xn, pre), w, KW["norm_eps"])
  return (Xn.astype(jnp.bfloat16), x, *coefficients)


def test_gradients_of_bfloat16_streams():
  """The kernel sums X''s four cotangents (the output's, the collapse's, the mix's, the mean
  square's) in float32 and rounds gX and gF once; the op rounds X''s cotangent to bfloat16 after
  each of its three sums. Against the op restated with float32 sums: gX, gF within one bfloat16
  ulp (a float32 difference crossing a rounding midpoint), the rest to float32 rounding (the
  mix's x̂ cotangent is 16 bits of gy·fn in both). Against the op itself: X''s cotangent carries
  up to three bfloat16 roundings there and gX, gF a fourth, ≤ 4 · 2⁻⁹ of the largest value."""
  args = _inputs(9, lead=LEAD, d=D, dtype=jnp.bfloat16)
  got = _vjp_all(_fused, args)
  f32_sums = _vjp_all(_op_float32_cotangents, args)
  for name, g, w in zip(SITE[:2], got[:2], f32_sums[:2]):
    assert g.dtype == w.dtype == jnp.bfloat16, name
    _within_bf16_ulp(g, w)
  _close_grads(got[2:], f32_sums[2:], SITE[2:])
  op = _vjp_all(_op, args)
  _close_grads(got[:4], op[:4], SITE[:4], rtol=4 * 2.0 ** -9)
  _close_grads(got[4:], op[4:], SITE[4:])


def test_layer_remat_keeps_the_mix_and_gates():
  """Under the model's remat policy the gradient program runs the gate kernel once (its rows and
  the stats row, mix and mean square, are named `ops.mhc.MIX`); the site's forward kernel runs
  again in the backward only for X' and x, which layer remat recomputes anyway. Saving nothing
  reruns the gate kernel too."""
  args = _inputs(5, lead=(2, 16), d=32, dtype=jnp.bfloat16)

  def loss(*a):
    return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in _fused(*a))

  def counts(f):
    g = jax.make_jaxpr(jax.grad(f, argnums=(0, 5)))(*args).jaxpr
    kernel = lambda name: lambda e: f"'{name}'" in str(e.params)  # noqa: E731
    return {k: len(testing.jaxpr_eqns(g, "pallas_call", kernel(k)))
            for k in ("mhc_site_fwd", "mhc_gates", "mhc_gates_bwd", "mhc_site_bwd")}

  assert counts(loss) == dict(mhc_site_fwd=1, mhc_gates=1, mhc_gates_bwd=1, mhc_site_bwd=1)
  remat = lambda policy: jax.checkpoint(loss, prevent_cse=False, policy=policy)  # noqa: E731
  assert counts(remat(M.remat_policy)) == dict(mhc_site_fwd=2, mhc_gates=1, mhc_gates_bwd=1,
                                               mhc_site_bwd=1)
  assert counts(remat(jax.checkpoint_policies.nothing_saveable))["mhc_gates"] == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_for_cuda(dtype):
  # Triton lowering on the CPU host (what interpret mode cannot see): the forward is the site
  # kernel and the gates'; the gradient the site's forward and backward kernels and the gates'
  # backward (the gates' forward rows are not needed for the gradient).
  args = _inputs(0, lead=(2, 64), d=256, dtype=dtype)
  fwd = lambda *a: mhc_site.hc_site(*a, **KW, interpret=False)  # noqa: E731

  def loss(*a):
    return sum(jnp.sum(o.astype(jnp.float32)) for o in fwd(*a))
  lowered = lower_for_cuda(fwd, *args)
  assert "mhc_site_fwd" in lowered.as_text() and triton_calls(lowered) == 2
  lowered = lower_for_cuda(jax.grad(loss, argnums=tuple(range(9))), *args)
  assert "mhc_site_bwd" in lowered.as_text() and triton_calls(lowered) == 3


def test_unsupported_reason(monkeypatch):
  assert mhc_site.unsupported_reason(*_inputs(0, lead=(1, 4), d=32), **KW) is None
  assert "power-of-two chunk" in mhc_site.unsupported_reason(*_inputs(0, lead=(1, 4), d=24), **KW)
  three = _inputs(0, lead=(1, 4), n=3, d=32)
  assert mhc_site.unsupported_reason(*three, **KW) is None      # interpreted: any n
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert "hc_mult 3" in mhc_site.unsupported_reason(*three, **KW)
