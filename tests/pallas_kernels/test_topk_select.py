"""pallas_kernels/topk_select.py against lax.top_k (through dsv41_jax.layers.indexer.select_topk)
and the op `indexer_topk` (pallas_kernels.ops.indexer.score_and_select)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers.indexer import select_topk
from pallas_kernels import topk_select as tsel
from pallas_kernels.ops import indexer as ops_indexer
from pallas_kernels.topk_select import ordered_keys, radix_topk
from tests.pallas_kernels.test_indexer import _inputs


def _sets(topk):
  return np.sort(np.asarray(topk), axis=-1)


@pytest.mark.parametrize("levels", [None, 7, 2])
def test_same_set_as_lax_top_k_with_planted_ties(levels):
  rng = np.random.default_rng(0 if levels is None else levels)
  B, T, N, k = 2, 41, 67, 9                    # N, k off any power of two
  s = rng.standard_normal((B, T, N)).astype(np.float32)
  if levels is not None:                       # few distinct values: ties straddle the k-th
    s = np.round(s * levels / 3) / levels
  s[0, :5] = 0.0                               # rows of +0.0 with a few −0.0 (ordered below it)
  s[0, :5, ::3] = -0.0
  s[1, 7] = 1e30                               # all equal and huge
  s[1, 8, :] = -1e30
  vis = rng.random((B, T, N)) < 0.6
  vis[0, 10] = False                           # no visible entry
  vis[0, 11] = False
  vis[0, 11, [3, 60]] = True                   # fewer visible than k
  want, _ = select_topk(jnp.asarray(s), jnp.asarray(vis), k)
  got = radix_topk(jnp.asarray(s), jnp.asarray(vis), k)
  assert got.shape == want.shape and got.dtype == jnp.int32
  np.testing.assert_array_equal(_sets(got), _sets(want))
  assert (np.asarray(got)[0, 10] == -1).all()


def test_keys_follow_the_total_order():
  x = np.array([-np.inf, -3.5, -1e-40, -0.0, 0.0, 1e-40, 2.0, np.inf], np.float32)
  keys = np.asarray(ordered_keys(jnp.asarray(x))).astype(np.int64)
  assert (np.diff(keys) > 0).all()


@pytest.mark.parametrize("pool", [False, True])
def test_kernel_equals_the_op(pool):
  # The op's kernel: same sets, the same score at each selected entry, the same pool, and the same
  # gradient of a loss over the selected entries (summed by entry, so the slot order is free).
  q, w, kv, seg = _inputs(40 + pool, 2)
  args = (q, w, kv.index_k_BxNxI, kv.entry_segment_BxN, kv.entry_last_BxN, seg)
  kw = dict(k=6, make_pool=pool, block_size=4, topk_blocks=2)
  r = jnp.asarray(np.random.default_rng(0).standard_normal(kv.index_k_BxNxI.shape[:2]),
                  jnp.float32)

  def run(fn, q, w, k):
    topk, picked, p = fn(q, w, k, *args[3:], None, **kw)
    if pool:                                  # a consumer of that pool, restricted to it
      topk, picked, _ = fn(q, w, k, *args[3:], p, **dict(kw, make_pool=False))
    by_entry = jnp.zeros(r.shape).at[jnp.arange(r.shape[0])[:, None, None],
                                     jnp.maximum(topk, 0)].add(jnp.where(topk >= 0, picked, 0))
    return jnp.sum(by_entry * r), (topk, picked, p)

  grads = lambda fn: jax.jit(jax.grad(lambda *a: run(fn, *a), argnums=(0, 1, 2),
                                      has_aux=True))(*args[:3])
  (gw, (tw, sw, pw)), (gg, (tg, sg_, pg)) = grads(ops_indexer.score_and_select), grads(
      tsel.score_and_select)
  assert (np.asarray(tw) < 0).any()
  order = lambda t, s: (np.sort(np.asarray(t), -1),
                        np.take_along_axis(np.asarray(s), np.argsort(np.asarray(t), -1), -1))
  (tw_, sw_), (tg_, sg2) = order(tw, sw), order(tg, sg_)
  np.testing.assert_array_equal(tg_, tw_)
  np.testing.assert_array_equal(sg2, sw_)       # the same scores, gathered at the same entries
  if pool:
    np.testing.assert_array_equal(np.asarray(pg), np.asarray(pw))
  for a, b in zip(gg, gw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
