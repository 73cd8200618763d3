"""pallas_kernels/sparse_attention.py (interpret mode) against the op pallas_kernels.ops.sparse_attention."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers.indexer import select_topk
from dsv41_jax.layers.types import CompressedKV, entry_visible
from pallas_kernels import dispatch
from pallas_kernels import sparse_attention as ks
from pallas_kernels.ops import sparse_attention as sa
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls

B, T, H, W, K = 2, 37, 3, 8, 8   # T = 37: no block divides it; K = 8 > entries visible early on


def _inputs(seed, m, D=32, dtype=jnp.float32):
  """Random q/kv/entries/sink, two ragged documents per row (row 1 ends in padding), and a top-k
  from random scores over the visible entries (−1 where fewer than K are visible)."""
  rng = np.random.default_rng(seed)
  seg = np.ones((B, T), np.int32)
  seg[0, 13:] = 2
  seg[1, 22:] = 3
  seg[1, 33:] = 0
  N = -(-T // m)
  last = (np.arange(N) + 1) * m - 1
  eseg = np.full((B, N), -1, np.int32)
  for b in range(B):
    for g in range(N):
      toks = seg[b, g * m:(g + 1) * m]
      if last[g] < T and len(set(toks)) == 1 and toks[0] > 0:
        eseg[b, g] = toks[0]
  kv = CompressedKV(None, None, jnp.asarray(eseg), jnp.asarray(np.broadcast_to(last, (B, N))),
                    None)
  vis = entry_visible(kv, jnp.asarray(seg))
  topk, _ = select_topk(jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32), vis, K)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return dict(q=f(B, T, H, D), kv=f(B, T, D), seg=jnp.asarray(seg),
              sink=jnp.asarray(rng.standard_normal(H), jnp.float32), g=f(B, N, D), topk=topk)


def _run(fn, x, D=32, **kw):
  return fn(x["q"], x["kv"], x["seg"], x["sink"], window=W, scale=D ** -0.5,
            global_kv_BxNxD=x["g"], topk_BxTxK=x["topk"], **kw)


def _kernel(*a, **kw):
  return ks.sparse_attend(*a, **kw, interpret=True, block_k=4, block_k_bwd=8)


@pytest.mark.parametrize("m", [1, 2])
def test_forward_and_gradients_match_reference(m):
  x = _inputs(m, m)
  assert int(jnp.sum(x["topk"][:, 1] < 0)) > 0 and int(jnp.sum(x["topk"] >= 0)) > 0
  o, probs = _run(_kernel, x)
  ro, rprobs = _run(sa.attend_reference, x)
  mo, _ = _run(sa.attend, x)
  # float32 throughout (HIGHEST dots): only the summation order differs, ~1e-7 relative on
  # values of size ~1 over at most W + K = 16 keys.
  np.testing.assert_allclose(np.asarray(o), np.asarray(ro), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(o), np.asarray(mo), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(probs), np.asarray(rprobs), rtol=1e-5, atol=1e-6)

  r = jnp.asarray(np.random.default_rng(10 + m).standard_normal(o.shape), jnp.float32)

  def loss(fn):
    def f(q, kv, sink, g):
      o, _ = _run(fn, dict(x, q=q, kv=kv, sink=sink, g=g))
      return jnp.sum(o * r)
    return jax.grad(f, argnums=(0, 1, 2, 3))(x["q"], x["kv"], x["sink"], x["g"])

  for got, want in zip(loss(_kernel), loss(sa.attend_reference)):
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 0.1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)


def test_bfloat16_and_window_only():
  x = _inputs(3, 2, D=64, dtype=jnp.bfloat16)
  o, probs = _run(_kernel, x, D=64)
  assert o.dtype == jnp.bfloat16
  x32 = {k: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for k, v in x.items()}
  ro, rprobs = _run(sa.attend_reference, x32, D=64)
  # bf16: the exponentials and the output are rounded to 8 significant bits (2^-9 relative each)
  # and the dots accumulate bf16 products in float32; 1e-2 relative is the bf16 bound.
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
  assert rel(o, ro) < 1e-2 and rel(probs, rprobs) < 1e-2
  ow, none = ks.sparse_attend(x["q"], x["kv"], x["seg"], x["sink"], window=W, scale=0.125,
                              interpret=True)
  rw, _ = sa.attend_reference(x32["q"], x32["kv"], x["seg"], x["sink"], window=W, scale=0.125)
  assert none is None and rel(ow, rw) < 1e-2


def _op(policy, x, D=32):
  return dispatch.call("sparse_attention", x["q"], x["kv"], x["seg"], x["sink"], x["g"], x["topk"],
                       policy=policy, window=W, scale=D ** -0.5)


def test_model_switch_and_fallback(caplog):
  x = _inputs(4, 2)
  assert dispatch.choose("sparse_attention", "kernel", x["q"], x["kv"], x["seg"], x["sink"],
                         x["g"], x["topk"], window=W, scale=0.125)[0] == (
      "pallas_kernels.sparse_attention:sparse_attend")
  o, p = _op("kernel", x)
  ro, rp = _run(sa.attend_reference, x)
  np.testing.assert_allclose(np.asarray(o), np.asarray(ro), rtol=1e-5, atol=1e-5)
  # head_dim 24 is no power of two: the XLA "masked" form runs, and says so once.
  rng = np.random.default_rng(5)
  y = dict(x, q=jnp.asarray(rng.standard_normal((B, T, H, 24)), jnp.float32),
           kv=jnp.asarray(rng.standard_normal((B, T, 24)), jnp.float32),
           g=jnp.asarray(rng.standard_normal(x["g"].shape[:2] + (24,)), jnp.float32))
  assert ks.unsupported_reason(y["q"], y["kv"], y["seg"], y["sink"], window=W) is not None
  with caplog.at_level(logging.INFO):
    for _ in range(2):
      o, _ = _op("auto", y, D=24)
  assert sum("runs the reference" in r.message and "head_dim 24" in r.message
             for r in caplog.records) == 1
  np.testing.assert_array_equal(np.asarray(o), np.asarray(_run(sa.attend, y, D=24)[0]))
  with pytest.raises(dispatch.PolicyError, match="op sparse_attention: policy 'kernel'.*head_dim 24"):
    _op("kernel", y, D=24)


def test_lowers_for_cuda():
  # Triton lowering (forward, probs, backward) on the CPU host for CUDA (cuda_lowering), with the
  # GPU layout: 16 heads, D a power of two.
  x = _inputs(6, 2, D=64, dtype=jnp.bfloat16)
  x["q"] = jnp.tile(x["q"], (1, 1, 6, 1))[:, :, :16]
  x["sink"] = jnp.zeros((16,), jnp.float32)

  def loss(q, kv, g, sink):
    o, p = ks.sparse_attend(q, kv, x["seg"], sink, window=W, scale=0.125, global_kv_BxNxD=g,
                            topk_BxTxK=x["topk"], interpret=False)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(p)

  lowered = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2, 3)), x["q"], x["kv"], x["g"],
                           x["sink"])
  assert triton_calls(lowered) == 3   # forward, probs, backward: no fallback to the reference
