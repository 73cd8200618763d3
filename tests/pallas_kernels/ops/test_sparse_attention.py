"""pallas_kernels/ops/sparse_attention.py (docs/design.md §4.3): the window ∪ top-k attention with a
sink, its block-local and dense forms and their gradients, against a float64 loop."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ops import sparse_attention as sa


# --- independent float64 reference -------------------------------------------------------------


def np_attend(q, kv, seg, sink, window, scale, g=None, topk=None):
  """docs/design.md §4.3 by loops: per (b, t, h), one softmax over window ∪ selected entries + sink."""
  q, kv, sink = (np.asarray(a, np.float64) for a in (q, kv, sink))
  seg = np.asarray(seg)
  B, T, H, D = q.shape
  o = np.zeros((B, T, H, D))
  K = 0 if topk is None else topk.shape[-1]
  probs = np.zeros((B, T, K))
  for b in range(B):
    for t in range(T):
      vals, slots = [], []
      if seg[b, t] > 0:
        for j in range(max(0, t - window + 1), t + 1):
          if seg[b, j] == seg[b, t]:
            vals.append(kv[b, j])
            slots.append(-1)
      for k in range(K):
        if topk[b, t, k] >= 0:
          vals.append(np.asarray(g, np.float64)[b, topk[b, t, k]])
          slots.append(k)
      for h in range(H):
        s = np.array([q[b, t, h] @ v * scale for v in vals])
        M = max(s.max() if len(s) else -np.inf, sink[h])
        e = np.exp(s - M)
        p = e / (e.sum() + np.exp(sink[h] - M))
        o[b, t, h] = sum((pi * v for pi, v in zip(p, vals)), np.zeros(D))
        for pi, k in zip(p, slots):
          if k >= 0:
            probs[b, t, k] += pi
  return o, probs


# --- inputs ----------------------------------------------------------------------------------


def packed_segments(rng, B, T):
  """Rows of several documents of random lengths, then padding (segment 0)."""
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    t, doc = 0, 1
    while t < T - 3:
      n = int(rng.integers(2, T // 2))
      n = min(n, T - 3 - t)
      seg[b, t:t + n] = doc
      pos[b, t:t + n] = np.arange(n)
      t, doc = t + n, doc + 1
  return seg, pos


def random_topk(rng, B, T, K, N, p_empty=0.3):
  """Distinct entries per (b, t) with some −1 slots."""
  topk = np.stack([np.stack([rng.permutation(N)[:K] for _ in range(T)]) for _ in range(B)])
  topk[rng.random(topk.shape) < p_empty] = -1
  return topk.astype(np.int32)


def attend_inputs(seed, B=2, T=29, H=3, D=8, N=15, K=6):
  rng = np.random.default_rng(seed)
  seg, _ = packed_segments(rng, B, T)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  topk = random_topk(rng, B, T, K, N)
  topk[seg == 0] = -1  # as the indexer leaves them: padding selects nothing
  return dict(q=f(B, T, H, D), kv=f(B, T, D), seg=seg, sink=2 * f(H), g=f(B, N, D), topk=topk)


@partial(jax.jit, static_argnames=("window", "impl"))
def _attend(q, kv, seg, sink, g, topk, *, window, impl):
  return sa.attend(q, kv, seg, sink, window=window, scale=8 ** -0.5, global_kv_BxNxD=g,
                   topk_BxTxK=topk, impl=impl)


# --- sparse_attention.attend -------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["masked", "gather"])
@pytest.mark.parametrize("window", [5, 40])   # T = 29: several blocks; one block (window > T)
def test_attend_matches_loop(impl, window):
  a = attend_inputs(seed=window)
  o, probs = _attend(a["q"], a["kv"], a["seg"], a["sink"], a["g"], a["topk"], window=window,
                     impl=impl)
  o_ref, probs_ref = np_attend(a["q"], a["kv"], a["seg"], a["sink"], window, 8 ** -0.5, a["g"],
                               a["topk"])
  np.testing.assert_allclose(np.asarray(o), o_ref, rtol=0, atol=2e-6)
  np.testing.assert_allclose(np.asarray(probs), probs_ref, rtol=0, atol=1e-6)
  assert np.all(np.asarray(probs)[a["topk"] < 0] == 0)
  assert np.all(np.asarray(o)[a["seg"] == 0] == 0)  # padding sees nothing; the sink takes it all


def test_attend_swa_only_and_reference():
  a = attend_inputs(seed=3)
  o, probs = jax.jit(partial(sa.attend, window=4, scale=0.3))(a["q"], a["kv"], a["seg"], a["sink"])
  assert probs is None
  o_ref, _ = np_attend(a["q"], a["kv"], a["seg"], a["sink"], 4, 0.3)
  np.testing.assert_allclose(np.asarray(o), o_ref, rtol=0, atol=2e-6)
  o_dense, probs_dense = jax.jit(partial(sa.attend_reference, window=6, scale=0.3))(
      a["q"], a["kv"], a["seg"], a["sink"], global_kv_BxNxD=a["g"], topk_BxTxK=a["topk"])
  o_ref, probs_ref = np_attend(a["q"], a["kv"], a["seg"], a["sink"], 6, 0.3, a["g"], a["topk"])
  np.testing.assert_allclose(np.asarray(o_dense), o_ref, rtol=0, atol=2e-6)
  np.testing.assert_allclose(np.asarray(probs_dense), probs_ref, rtol=0, atol=1e-6)


def test_gradients_agree_with_dense_reference():
  a = attend_inputs(seed=5)
  rng = np.random.default_rng(6)
  w_o = rng.standard_normal(a["q"].shape).astype(np.float32)
  w_p = rng.standard_normal(a["topk"].shape).astype(np.float32)

  def loss(q, kv, sink, g, impl):
    fn = sa.attend_reference if impl == "reference" else partial(sa.attend, impl=impl)
    o, p = fn(q, kv, a["seg"], sink, window=5, scale=0.35, global_kv_BxNxD=g,
              topk_BxTxK=a["topk"])
    return jnp.sum(o * w_o) + jnp.sum(p * w_p)

  grads = {impl: jax.jit(jax.grad(partial(loss, impl=impl), argnums=(0, 1, 2, 3)))(
      a["q"], a["kv"], a["sink"], a["g"]) for impl in ("masked", "gather", "reference")}
  for gm, gg, gr in zip(grads["masked"], grads["gather"], grads["reference"]):
    assert np.all(np.isfinite(gm))
    np.testing.assert_allclose(np.asarray(gm), np.asarray(gr), rtol=0, atol=3e-6)
    np.testing.assert_allclose(np.asarray(gg), np.asarray(gr), rtol=0, atol=3e-6)
  # Padding queries and unselected entries receive no gradient.
  assert np.all(np.asarray(grads["masked"][0])[a["seg"] == 0] == 0)
  unused = np.setdiff1d(np.arange(a["g"].shape[1]), a["topk"][a["topk"] >= 0])
  assert np.all(np.asarray(grads["gather"][3])[:, unused] == 0)


@pytest.mark.parametrize("impl", ["masked", "gather"])
def test_query_chunks_compute_the_same(impl):
  """Chunked queries (scanned, rematerialised) give the unchunked values and gradients."""
  a = attend_inputs(seed=13, T=31)
  rng = np.random.default_rng(14)
  w_o = rng.standard_normal(a["q"].shape).astype(np.float32)

  def run(chunk):
    def loss(q, kv, sink, g):
      o, p = sa.attend(q, kv, a["seg"], sink, window=4, scale=0.35, global_kv_BxNxD=g,
                       topk_BxTxK=a["topk"], impl=impl, query_chunk=chunk)
      return jnp.sum(o * w_o), (o, p)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        a["q"], a["kv"], a["sink"], a["g"])

  (_, (o1, p1)), g1 = run(None)
  (_, (o2, p2)), g2 = run(12)  # 8 blocks of 4 rows → 3 chunks of 3 blocks, the last one padded
  np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=0, atol=5e-7)
  np.testing.assert_allclose(np.asarray(p2), np.asarray(p1), rtol=0, atol=5e-7)
  for x1, x2 in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(x2), np.asarray(x1), rtol=0, atol=2e-6)


@pytest.mark.parametrize("impl", ["masked", "gather"])
def test_attend_bfloat16(impl):
  """bf16 inputs: products in bf16, scores and sums in fp32. Each exponential is rounded once to
  bf16 (relative error ≤ 2⁻⁹) and so is the output, so |o − o_exact| ≤ 2·2⁻⁹·max|v| + fp32 noise."""
  a = attend_inputs(seed=17)
  bf = {k: jnp.asarray(a[k], jnp.bfloat16) for k in ("q", "kv", "g")}
  o, probs = _attend(bf["q"], bf["kv"], a["seg"], a["sink"], bf["g"], a["topk"], window=5, impl=impl)
  assert o.dtype == jnp.bfloat16 and probs.dtype == jnp.float32
  f64 = {k: np.asarray(v, np.float64) for k, v in bf.items()}
  o_ref, probs_ref = np_attend(f64["q"], f64["kv"], a["seg"], a["sink"], 5, 8 ** -0.5, f64["g"],
                               a["topk"])
  vmax = max(np.abs(f64["kv"]).max(), np.abs(f64["g"]).max())
  np.testing.assert_allclose(np.asarray(o, np.float64), o_ref, rtol=0, atol=2 * 2.0 ** -9 * vmax)
  np.testing.assert_allclose(np.asarray(probs), probs_ref, rtol=2.0 ** -8, atol=1e-6)


def test_window_holds_query_and_exactly_w_keys():
  """The keys that influence o[t] are exactly rows t−W+1 … t of t's document."""
  W, T = 6, 27
  rng = np.random.default_rng(7)
  seg = np.array([[1] * 16 + [2] * 9 + [0] * 2], np.int32)
  q = rng.standard_normal((1, T, 2, 8)).astype(np.float32)
  kv = rng.standard_normal((1, T, 8)).astype(np.float32)
  sink = rng.standard_normal(2).astype(np.float32)
  jac = jax.jit(jax.jacrev(lambda kv: sa.attend(q, kv, seg, sink, window=W, scale=0.35)[0]))(kv)
  influence = np.abs(np.asarray(jac)).sum(axis=(0, 2, 3, 4, 6))          # [t, j]
  for t in range(T):
    expected = {j for j in range(t - W + 1, t + 1) if j >= 0 and seg[0, j] == seg[0, t] > 0}
    assert set(np.nonzero(influence[t])[0]) == expected, t
    if seg[0, t] > 0 and t - W + 1 >= 0 and seg[0, t - W + 1] == seg[0, t]:
      assert len(expected) == W and t in expected


def test_documents_do_not_mix():
  """Changing one document's queries, keys and entries leaves every other row bitwise unchanged."""
  a = attend_inputs(seed=11)
  rng = np.random.default_rng(12)
  doc = a["seg"] == 2
  q2, kv2 = a["q"].copy(), a["kv"].copy()
  q2[doc] = rng.standard_normal(q2[doc].shape)
  kv2[doc] = rng.standard_normal(kv2[doc].shape)
  # Entries selected only by doc-2 queries may change too.
  only_doc2 = np.setdiff1d(a["topk"][doc], a["topk"][~doc])
  g2 = a["g"].copy()
  for b in range(g2.shape[0]):
    g2[b, only_doc2[only_doc2 >= 0]] = rng.standard_normal((np.sum(only_doc2 >= 0), g2.shape[2]))
  for impl in ("masked", "gather"):
    o1, p1 = _attend(a["q"], a["kv"], a["seg"], a["sink"], a["g"], a["topk"], window=5, impl=impl)
    o2, p2 = _attend(q2, kv2, a["seg"], a["sink"], g2, a["topk"], window=5, impl=impl)
    np.testing.assert_array_equal(np.asarray(o1)[~doc], np.asarray(o2)[~doc])
    np.testing.assert_array_equal(np.asarray(p1)[~doc], np.asarray(p2)[~doc])
    assert not np.allclose(np.asarray(o1)[doc], np.asarray(o2)[doc])
