"""Tests of dsv41_jax/layers/sparse_attention.py and dsv41_jax/layers/attention.py (docs/design.md §4, §14)."""

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import quant, sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers import sparse_attention as sa
from dsv41_jax.layers.attention import Attention
from dsv41_jax.layers.types import CompressedKV


# --- independent float64 references ------------------------------------------------------------


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


def np_rope(x, pos, inv, sign=1.0):
  """Rotate interleaved pairs of the trailing 2·len(inv) channels of x [B, T, ..., C] by pos [B, T].

  The angle pos·ω is rounded to float32 as `apply_rope` forms it (its precision is rope.py's,
  tested there); the rotation itself is float64.
  """
  x = np.array(x, np.float64)
  r = 2 * len(inv)
  ang = sign * (pos.astype(np.float32)[..., None] * np.asarray(inv, np.float32)).astype(np.float64)
  while ang.ndim < x.ndim:
    ang = ang[:, :, None]
  a, b = x[..., -r::2].copy(), x[..., -r + 1::2].copy()
  x[..., -r::2] = a * np.cos(ang) - b * np.sin(ang)
  x[..., -r + 1::2] = a * np.sin(ang) + b * np.cos(ang)
  return x


def np_rms(x, w, eps):
  x = np.asarray(x, np.float64)
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y if w is None else y * np.asarray(w, np.float64)


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


# --- the Attention module ------------------------------------------------------------------------


def tiny_cfg(**changes):
  """Six layers: SWA, then m = 2 Full + Reuse in the encoder and Full + 2 Reuse in the decoder."""
  return ModelConfig(
      vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, head_dim=32,
      qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=24, sliding_window=8,
      compress_ratios=(0, 2, 2, 2, 2, 2), kv_source_layer_ids=(1, 3),
      index_source_layer_ids=(1, 3), index_n_heads=2, index_head_dim=16, index_topk=8,
      engram_layer_ids=(), seq_len=64, dtype="float32").replace(**changes)


def randomize(att, rng):
  """Non-trivial norm weights and sinks (their inits are 1 and 0)."""
  for norm in (att.q_norm, att.kv_norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  att.attn_sink[...] = jnp.asarray(rng.standard_normal(att.attn_sink.shape), jnp.float32)


def compressed_kv(rng, seg, pos, m, D):
  """A CompressedKV with the metadata of docs/design.md §14 for groups of m tokens, random entries."""
  B, T = seg.shape
  N = T // m
  g_seg = seg[:, :N * m].reshape(B, N, m)
  entry_seg = np.where(np.all(g_seg == g_seg[..., :1], -1) & (g_seg[..., 0] > 0), g_seg[..., 0], -1)
  last = np.broadcast_to(np.arange(N) * m + m - 1, (B, N))
  return CompressedKV(jnp.asarray(rng.standard_normal((B, N, D)), jnp.float32), None,
                      jnp.asarray(entry_seg, jnp.int32), jnp.asarray(last, jnp.int32),
                      jnp.asarray(pos[:, ::m][:, :N], jnp.int32))


@pytest.mark.parametrize("q_head_norm,impl", [(False, "masked"), (True, "gather")])
def test_module_matches_numpy(q_head_norm, impl):
  """The whole layer (§4.1–4.4) against a float64 numpy re-computation, packed rows, global part."""
  cfg = tiny_cfg(q_head_norm=q_head_norm, global_attn_impl=impl)
  spec = build_layer_plan(cfg)[2]  # a Reuse layer at m = 2: window + global entries
  rng = np.random.default_rng(20)
  att = Attention(cfg, spec, nnx.Rngs(21))
  randomize(att, rng)
  B, T = 2, 22
  seg, pos = packed_segments(rng, B, T)
  x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
  kv = compressed_kv(rng, seg, pos, 2, cfg.head_dim)
  topk = random_topk(rng, B, T, cfg.index_topk, T // 2, p_empty=0.2)
  y, c_q, probs = nnx.jit(lambda att, x: att(x, positions_BxT=pos, segment_ids_BxT=seg, kv=kv,
                                             topk_BxTxK=topk))(att, x)

  P = {k: np.asarray(v, np.float64) for k, v in
       dict(wq_a=att.wq_a, wq_b=att.wq_b, wkv=att.wkv, wo_a=att.wo_a, wo_b=att.wo_b,
            qn=att.q_norm.scale, kn=att.kv_norm.scale, sink=att.attn_sink).items()}
  inv, eps = np.asarray(att.inv_freq), cfg.rms_norm_eps
  cq_ref = np_rms(x @ P["wq_a"], P["qn"], eps)
  q = np.einsum("btq,qhd->bthd", cq_ref, P["wq_b"])
  if q_head_norm:
    q = np_rms(q, None, eps)
  q = np_rope(q, pos, inv)
  k = np_rope(np_rms(x @ P["wkv"], P["kn"], eps), pos, inv)
  # The module drops slots naming entries invisible to the query (future, other document).
  t = np.arange(T)[None, :, None]
  ent_seg, ent_last = np.asarray(kv.entry_segment_BxN), np.asarray(kv.entry_last_BxN)
  tk = np.maximum(topk, 0)
  ok = ((topk >= 0) & (np.take_along_axis(ent_last[:, None], tk, -1) <= t)
        & (np.take_along_axis(ent_seg[:, None], tk, -1) == seg[:, :, None]) & (seg[:, :, None] > 0))
  topk_vis = np.where(ok, topk, -1)
  o, probs_ref = np_attend(q, k, seg, P["sink"], cfg.sliding_window, cfg.head_dim ** -0.5,
                           np.asarray(kv.main_kv_BxNxD), topk_vis)
  o = np_rope(o, pos, inv, sign=-1.0)                                      # de-rotate (§4.4)
  G = cfg.o_groups
  u = np.einsum("btgi,gio->btgo", o.reshape(B, T, G, -1), P["wo_a"])
  y_ref = u.reshape(B, T, -1) @ P["wo_b"]

  np.testing.assert_allclose(np.asarray(c_q), cq_ref, rtol=0, atol=3e-6)
  np.testing.assert_allclose(np.asarray(probs), probs_ref, rtol=0, atol=2e-6)
  scale = np.abs(y_ref).max()
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=0, atol=2e-6 * scale)
  assert np.any(ok) and np.any((topk >= 0) & ~ok)  # the test exercises both kinds of slot


def test_module_output_path():
  """§4.4 alone: de-rotation by the query position, block-diagonal wo_a, then wo_b."""
  cfg = tiny_cfg()
  att = Attention(cfg, build_layer_plan(cfg)[0], nnx.Rngs(30))
  rng = np.random.default_rng(31)
  B, T, H, D = 2, 9, cfg.num_attention_heads, cfg.head_dim
  o = rng.standard_normal((B, T, H, D)).astype(np.float32)
  pos = rng.integers(0, 5000, (B, T)).astype(np.int32)
  y = att.output(jnp.asarray(o), jnp.asarray(pos))
  inv = np.asarray(att.inv_freq)
  o_d = np_rope(o, pos, inv, sign=-1.0)
  hpg = cfg.heads_per_group
  wo_a, wo_b = np.asarray(att.wo_a, np.float64), np.asarray(att.wo_b, np.float64)
  u = [np.concatenate([o_d[:, :, g * hpg + i] for i in range(hpg)], -1) @ wo_a[g]
       for g in range(cfg.o_groups)]
  y_ref = np.concatenate(u, -1) @ wo_b
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=0, atol=2e-6 * np.abs(y_ref).max())


def test_module_causal_and_document_local():
  """Changing x after t (and the entries completed after t) leaves y[:t+1] bitwise unchanged;
  changing one document leaves the others bitwise unchanged."""
  cfg = tiny_cfg()
  spec = build_layer_plan(cfg)[2]
  att = Attention(cfg, spec, nnx.Rngs(40))
  rng = np.random.default_rng(41)
  randomize(att, rng)
  B, T, t0 = 1, 40, 23
  seg = np.array([[1] * 17 + [2] * 20 + [0] * 3], np.int32)
  pos = np.concatenate([np.arange(17), np.arange(20), np.zeros(3)])[None].astype(np.int32)
  kv = compressed_kv(rng, seg, pos, 2, cfg.head_dim)
  topk = random_topk(rng, B, T, cfg.index_topk, T // 2, p_empty=0.0)  # includes future entries
  run = nnx.jit(lambda att, x, kv: att(x, positions_BxT=pos, segment_ids_BxT=seg, kv=kv,
                                       topk_BxTxK=topk))
  x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
  y1, _, p1 = run(att, x, kv)

  x2 = x.copy()
  x2[:, t0 + 1:] = rng.standard_normal(x2[:, t0 + 1:].shape)
  future = np.asarray(kv.entry_last_BxN)[0] > t0
  kv2 = kv._replace(main_kv_BxNxD=kv.main_kv_BxNxD.at[:, future].set(
      jnp.asarray(rng.standard_normal((B, future.sum(), cfg.head_dim)), jnp.float32)))
  y2, _, p2 = run(att, x2, kv2)
  np.testing.assert_array_equal(np.asarray(y1)[:, :t0 + 1], np.asarray(y2)[:, :t0 + 1])
  np.testing.assert_array_equal(np.asarray(p1)[:, :t0 + 1], np.asarray(p2)[:, :t0 + 1])
  assert not np.allclose(np.asarray(y1)[:, t0 + 1:37], np.asarray(y2)[:, t0 + 1:37])

  doc1 = seg[0] == 1
  x3 = x.copy()
  x3[:, doc1] = rng.standard_normal(x3[:, doc1].shape)
  ents1 = np.asarray(kv.entry_segment_BxN)[0] == 1
  kv3 = kv._replace(main_kv_BxNxD=kv.main_kv_BxNxD.at[:, ents1].set(
      jnp.asarray(rng.standard_normal((B, ents1.sum(), cfg.head_dim)), jnp.float32)))
  y3, _, p3 = run(att, x3, kv3)
  np.testing.assert_array_equal(np.asarray(y1)[:, ~doc1], np.asarray(y3)[:, ~doc1])
  np.testing.assert_array_equal(np.asarray(p1)[:, ~doc1], np.asarray(p3)[:, ~doc1])


def test_fp8_swa_kv_and_params():
  cfg = tiny_cfg(fp8_swa_kv=True, dtype="bfloat16")
  spec = build_layer_plan(cfg)[0]
  att = Attention(cfg, spec, nnx.Rngs(50))
  rng = np.random.default_rng(51)
  x = jnp.asarray(rng.standard_normal((2, 11, cfg.hidden_size)), jnp.bfloat16)
  pos = jnp.asarray(rng.integers(0, 100, (2, 11)), jnp.int32)
  swa_kv = nnx.jit(lambda a, x: a.swa_kv(x, pos))
  kv = swa_kv(att, x)
  plain = Attention(cfg.replace(fp8_swa_kv=False), spec, nnx.Rngs(50))
  np.testing.assert_array_equal(np.asarray(kv, np.float32),
                                np.asarray(quant.fp8_swa(swa_kv(plain, x)), np.float32))
  # Every block of 32 is an E4M3 value times a power of two.
  blocks = np.asarray(kv, np.float32).reshape(2, 11, -1, 32)
  amax = np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-4)
  scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
  codes = blocks / scale
  np.testing.assert_array_equal(codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), codes)
  y, c_q, probs = nnx.jit(lambda a, x: a(x, positions_BxT=pos,
                                         segment_ids_BxT=jnp.ones((2, 11), jnp.int32)))(att, x)
  assert y.dtype == jnp.bfloat16 and c_q.shape == (2, 11, cfg.q_lora_rank) and probs is None
  assert np.all(np.isfinite(np.asarray(y, np.float32)))
  axes = {"/".join(map(str, p)): sharding.param_axes(v) for p, v in
          nnx.to_flat_state(nnx.state(att, nnx.Param))}
  assert axes == {"wq_a": ("embed", "q_lora"), "q_norm/scale": ("norm",),
                  "wq_b": ("q_lora", "heads", "head_dim"), "wkv": ("embed", "kv"),
                  "kv_norm/scale": ("norm",), "attn_sink": ("heads",),
                  "wo_a": ("o_groups", "o_in", "o_lora"), "wo_b": ("o_cat", "embed")}
  assert att.attn_sink.dtype == jnp.float32 and np.all(np.asarray(att.attn_sink) == 0)
