"""dsv41_jax/layers/indexer.py against float64 loops of docs/design.md §5.3–5.6 and §14."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common, tiny
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers import indexer as idx_lib
from dsv41_jax.layers.compressor import Compressor
from dsv41_jax.layers.rope import layer_inv_freq
from dsv41_jax.layers.types import CompressedKV, entry_visible
from tests.dsv41_jax.layers.test_compressor import POS, SEG, np_rms, np_rope


def _cfg(**kw):
  return common.model_config(tiny.get_config()).replace(**kw)


def np_scores(q, k, w):
  q, k, w = (a.astype(np.float64) for a in (q, k, w))
  b, t, h, d = q.shape
  out = np.zeros((b, t, k.shape[1]))
  for bi in range(b):
    for ti in range(t):
      for n in range(k.shape[1]):
        out[bi, ti, n] = sum(w[bi, ti, hh] * max(q[bi, ti, hh] @ k[bi, n], 0.0)
                             for hh in range(h)) / np.sqrt(d)
  return out


def np_topk(scores, mask, k):
  b, t, n = scores.shape
  kk = min(k, n)
  idx = np.full((b, t, kk), -1)
  val = np.zeros((b, t, kk))
  for bi in range(b):
    for ti in range(t):
      cand = np.flatnonzero(mask[bi, ti])
      order = cand[np.argsort(-scores[bi, ti, cand], kind="stable")][:kk]
      idx[bi, ti, :len(order)] = order
      val[bi, ti, :len(order)] = scores[bi, ti, order]
  return idx, val


def np_pool(scores, vis, bs, kb):
  b, t, n = scores.shape
  nb = -(-n // bs)
  kk = min(kb, nb)
  out = np.full((b, t, kk), -1)
  for bi in range(b):
    for ti in range(t):
      seen = np.flatnonzero(vis[bi, ti])
      if not len(seen):
        continue
      block = {}
      for g in seen:
        block[g // bs] = max(block.get(g // bs, -np.inf), scores[bi, ti, g])
      block[seen.max() // bs] = np.inf  # the newest visible block is always kept
      order = sorted(block, key=lambda j: -block[j])[:kk]
      out[bi, ti, :len(order)] = order
  return out


def test_scores_match_loop():
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
  k = rng.standard_normal((2, 7, 8)).astype(np.float32)
  w = rng.standard_normal((2, 5, 3)).astype(np.float32)
  got = idx_lib.indexer_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w))
  np.testing.assert_allclose(np.asarray(got), np_scores(q, k, w), rtol=1e-5, atol=1e-6)


def test_topk_matches_argsort_with_padding():
  rng = np.random.default_rng(1)
  scores = rng.standard_normal((2, 9, 11)).astype(np.float32)
  vis = rng.random((2, 9, 11)) < np.linspace(0.0, 1.0, 9)[None, :, None]  # 0 … all visible
  assert (vis.sum(-1) < 4).any() and (vis.sum(-1) == 0).any()
  for k in (4, 20):  # k > N returns N slots
    topk, picked = idx_lib.select_topk(jnp.asarray(scores), jnp.asarray(vis), k)
    ref_i, ref_v = np_topk(scores, vis, k)
    np.testing.assert_array_equal(np.asarray(topk), ref_i)
    np.testing.assert_array_equal(np.asarray(picked), ref_v.astype(np.float32))
  # the gradient of the picked scores lands on the picked entries only
  g = jax.grad(lambda s: idx_lib.select_topk(s, jnp.asarray(vis), 4)[1].sum())(jnp.asarray(scores))
  want = np.zeros_like(scores)
  ref_i, _ = np_topk(scores, vis, 4)
  for bi, ti, j in zip(*np.nonzero(ref_i >= 0)):
    want[bi, ti, ref_i[bi, ti, j]] = 1.0
  np.testing.assert_array_equal(np.asarray(g), want)


def test_candidate_pool_and_mask_match_loop():
  rng = np.random.default_rng(2)
  scores = rng.standard_normal((2, 10, 13)).astype(np.float32)
  vis = rng.random((2, 10, 13)) < 0.6
  vis[0, 0] = False
  bs, kb = 3, 2
  pool = np.asarray(idx_lib.candidate_pool(jnp.asarray(scores), jnp.asarray(vis), bs, kb))
  ref = np_pool(scores, vis, bs, kb)
  np.testing.assert_array_equal(pool, ref)
  # the pinned newest block is in the pool even when its max score is the lowest
  newest = np.where(vis.any(-1), np.where(vis, np.arange(13), -1).max(-1) // bs, -1)
  assert all(newest[i] in pool[i] for i in np.ndindex(*newest.shape) if newest[i] >= 0)
  mask = np.asarray(idx_lib.candidate_mask(jnp.asarray(pool), 13, bs))
  want = np.zeros_like(mask)
  for i in np.ndindex(*pool.shape[:2]):
    for blk in pool[i]:
      if blk >= 0:
        want[i][blk * bs:(blk + 1) * bs] = True
  np.testing.assert_array_equal(mask, want)
  topk, _ = idx_lib.select_topk(jnp.asarray(scores), jnp.asarray(vis), 4, jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(topk), np_topk(scores, vis & want, 4)[0])
  empty = idx_lib.empty_candidate(_cfg(candidate_block_size=bs, candidate_topk_blocks=kb), 2, 10, 13)
  assert empty.shape == pool.shape and empty.dtype == pool.dtype and (np.asarray(empty) == -1).all()


def _layers(cfg, rng_seed=0):
  """The tiny decoder: Full layer 6 (m = 1, candidate source) and Reindex layer 8 (consumer)."""
  plan = build_layer_plan(cfg)
  full, reindex = plan[6], plan[8]
  assert (full.mode, reindex.mode) == ("full", "reindex")
  comp = Compressor(cfg, full, nnx.Rngs(rng_seed))
  ix_full = idx_lib.Indexer(cfg, full, nnx.Rngs(rng_seed + 1))
  ix_re = idx_lib.Indexer(cfg, reindex, nnx.Rngs(rng_seed + 2))
  rng = np.random.default_rng(rng_seed)
  for mod, name in ((comp.norm, "scale"), (ix_full.k_norm, "scale")):
    v = getattr(mod, name)
    v[...] = jnp.asarray(rng.uniform(0.5, 1.5, v.shape), jnp.float32)
  return full, reindex, comp, ix_full, ix_re


def _inputs(cfg, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((2, 13, cfg.hidden_size)).astype(np.float32)
  c_q = rng.standard_normal((2, 13, cfg.q_lora_rank)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(c_q)


def _np_query(ix, x, c_q, inv):
  q = np.einsum("btq,qhi->bthi", np.asarray(c_q, np.float64), np.asarray(ix.wq_b[...], np.float64))
  q = np_rope(q, POS, inv)
  w = np.asarray(x, np.float64) @ np.asarray(ix.weights_proj[...], np.float64)
  return q, w / np.sqrt(ix.n_heads)


def test_full_and_reindex_against_reference():
  """Full: keys from the latent; Reindex: own q/w against the shared index_k (docs/design.md §5.5)."""
  # a pool of 2 blocks of 2 entries and k = 3 < visible entries, so both restrict something
  cfg = _cfg(use_candidate_pool=True, candidate_topk_blocks=2, index_topk=3)
  full, reindex, comp, ix_full, ix_re = _layers(cfg)
  assert not hasattr(ix_re, "wk") and not hasattr(ix_re, "k_norm")
  assert (full.candidate_role, reindex.candidate_role) == ("source", "consumer")
  x, c_q = _inputs(cfg, 3)
  inv = layer_inv_freq(cfg, full)
  pos, seg = jnp.asarray(POS), jnp.asarray(SEG)
  inv_re = layer_inv_freq(cfg, reindex)

  @nnx.jit
  def forward(comp, ix_full, ix_re, x, c_q):
    main_kv, latent, es, el, ep = comp(x, pos, seg, inv)
    kv = CompressedKV(main_kv, ix_full.keys(latent, ep, inv), es, el, ep)
    full_out = ix_full(x, c_q, positions=pos, segment_ids=seg, kv=kv)
    re_out = ix_re(x, c_q, positions=pos, segment_ids=seg, kv=kv, candidate=full_out[2])
    return latent, kv, full_out, re_out

  latent, kv, (topk, picked, pool), (topk_r, picked_r, pool_r) = forward(comp, ix_full, ix_re,
                                                                        x, c_q)
  ep = kv.entry_pos_BxN
  # k^I = RoPE(RMSNorm_w(latent · wk)) at the entry positions, recomputed from the latent
  k_ref = np_rope(np_rms(np.asarray(latent, np.float64) @ np.asarray(ix_full.wk[...], np.float64),
                         np.asarray(ix_full.k_norm.scale[...], np.float64), cfg.rms_norm_eps),
                  np.asarray(ep), inv)
  np.testing.assert_allclose(np.asarray(kv.index_k_BxNxI), k_ref, rtol=1e-5, atol=1e-5)
  vis = np.asarray(entry_visible(kv, seg))

  q, w = _np_query(ix_full, x, c_q, inv)
  s_full = np_scores(q, k_ref, w)
  ref_i, ref_v = np_topk(s_full, vis, cfg.index_topk)
  assert (vis.sum(-1) > cfg.index_topk).any() and (vis.sum(-1) < cfg.index_topk).any()
  np.testing.assert_array_equal(np.asarray(topk), ref_i)
  np.testing.assert_allclose(np.asarray(picked), ref_v, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(pool), np_pool(
      s_full, vis, cfg.candidate_block_size, cfg.candidate_topk_blocks))

  # Reindex, scored against the shared index_k, restricted to the source's pool
  assert pool_r is None
  q, w = _np_query(ix_re, x, c_q, inv_re)
  s_re = np_scores(q, k_ref, w)
  in_pool = np.asarray(idx_lib.candidate_mask(pool, kv.index_k_BxNxI.shape[1],
                                              cfg.candidate_block_size))
  ref_i, ref_v = np_topk(s_re, vis & in_pool, cfg.index_topk)
  assert (vis & ~in_pool).any()  # the pool does restrict something here
  np.testing.assert_array_equal(np.asarray(topk_r), ref_i)
  np.testing.assert_allclose(np.asarray(picked_r), ref_v, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError):
    ix_re.keys(latent, ep, inv)
  with pytest.raises(ValueError):
    ix_re(x, c_q, positions=pos, segment_ids=seg, kv=kv)


def test_query_chunking_changes_nothing():
  cfg = _cfg(use_candidate_pool=True)
  full, _, comp, ix_full, _ = _layers(cfg, 5)
  x, c_q = _inputs(cfg, 6)
  inv = layer_inv_freq(cfg, full)
  pos, seg = jnp.asarray(POS), jnp.asarray(SEG)
  main_kv, latent, es, el, ep = comp(x, pos, seg, inv)
  weight = jnp.asarray(np.random.default_rng(7).standard_normal((2, 13, cfg.index_topk)),
                       jnp.float32)
  graphdef, state = nnx.split(ix_full)

  def run(st):
    ix = nnx.merge(graphdef, st)
    kv = CompressedKV(main_kv, ix.keys(latent, ep, inv), es, el, ep)
    out = ix(x, c_q, positions=pos, segment_ids=seg, kv=kv)
    return jnp.sum(out[1] * weight), out

  (_, whole), g_whole = jax.jit(jax.value_and_grad(run, has_aux=True))(state)
  ix_full.query_chunk = 5  # 13 rows → chunks of 5, 5, 3 (+2 padding rows)
  graphdef, state = nnx.split(ix_full)
  (_, chunked), g_chunked = jax.jit(jax.value_and_grad(run, has_aux=True))(state)
  for a, b in zip(whole, chunked):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_chunked)):
    assert np.abs(np.asarray(a)).max() > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def np_kl(scores, topk, mass, token_mask):
  total, count = 0.0, 0
  for i in np.ndindex(*topk.shape[:2]):
    s = topk[i] >= 0
    if not token_mask[i] or not s.any():
      continue
    p = mass[i][s] / mass[i][s].sum()
    logq = scores[i][s] - np.log(np.exp(scores[i][s]).sum())
    total += np.sum(p * (np.log(p) - logq))
    count += 1
  return total / count


def test_kl_loss_value_and_gradient():
  rng = np.random.default_rng(7)
  scores = rng.standard_normal((2, 4, 5))
  topk = rng.integers(0, 9, (2, 4, 5))
  topk[0, 1, 2:] = -1
  topk[1, 2] = -1          # no selected entry: not counted
  mass = rng.uniform(0.01, 1.0, (2, 4, 5))
  token_mask = np.ones((2, 4), bool)
  token_mask[1, 3] = False  # padding query: not counted
  args = lambda s: (s, jnp.asarray(topk), jnp.asarray(mass, jnp.float32), jnp.asarray(token_mask))
  got = idx_lib.indexer_kl_loss(*args(jnp.asarray(scores, jnp.float32)))
  np.testing.assert_allclose(float(got), np_kl(scores, topk, mass, token_mask), rtol=1e-5)
  # dKL/ds = (softmax_S(s) − p) / #counted tokens, zero off S and on uncounted tokens
  g = np.asarray(jax.grad(lambda s: idx_lib.indexer_kl_loss(*args(s)))(
      jnp.asarray(scores, jnp.float32)))
  want = np.zeros_like(scores)
  counted = [i for i in np.ndindex(2, 4) if token_mask[i] and (topk[i] >= 0).any()]
  for i in counted:
    s = topk[i] >= 0
    q = np.exp(scores[i][s]) / np.exp(scores[i][s]).sum()
    want[i][s] = (q - mass[i][s] / mass[i][s].sum()) / len(counted)
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_indexer_loss_trains_only_the_indexer():
  """jax.grad of the KL loss: exactly zero on the compressor and the inputs (docs/design.md §5.5)."""
  cfg = _cfg()
  full, _, comp, ix_full, _ = _layers(cfg, 9)
  x, c_q = _inputs(cfg, 10)
  inv = layer_inv_freq(cfg, full)
  pos, seg = jnp.asarray(POS), jnp.asarray(SEG)
  c_def, c_state = nnx.split(comp)
  i_def, i_state = nnx.split(ix_full)

  def loss(tree):
    comp_m, ix_m = nnx.merge(c_def, tree["compressor"]), nnx.merge(i_def, tree["indexer"])
    main_kv, latent, es, el, ep = comp_m(tree["x"], pos, seg, inv)
    kv = CompressedKV(main_kv, ix_m.keys(latent, ep, inv), es, el, ep)
    topk, picked, _ = ix_m(tree["x"], tree["c_q"], positions=pos, segment_ids=seg, kv=kv)
    # a target that depends on the backbone (as the attention mass does): it must not train it
    q_main = tree["x"][..., :cfg.head_dim]
    logits = jnp.einsum("btd,bnd->btn", q_main, main_kv)
    mass = jnp.take_along_axis(jax.nn.softmax(logits, -1), jnp.maximum(topk, 0), -1)
    return idx_lib.indexer_kl_loss(picked, topk, mass, seg > 0)

  tree = {"compressor": c_state, "indexer": i_state, "x": x, "c_q": c_q}
  val, g = jax.jit(jax.value_and_grad(loss))(tree)
  assert float(val) > 0
  for leaf in jax.tree.leaves(g["compressor"]) + [g["x"], g["c_q"]]:
    assert np.all(np.asarray(leaf) == 0)
  named = dict(nnx.to_flat_state(g["indexer"]))
  names = {"/".join(map(str, k)) for k in named}
  assert names == {"wq_b", "weights_proj", "wk", "k_norm/scale"}
  for k, v in named.items():
    assert np.abs(np.asarray(v[...])).max() > 0, k
