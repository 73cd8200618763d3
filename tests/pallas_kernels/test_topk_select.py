"""pallas_kernels/topk_select.py against lax.top_k (through dsv41_jax.layers.indexer.select_topk)."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers.indexer import select_topk
from pallas_kernels.topk_select import ordered_keys, radix_topk


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
