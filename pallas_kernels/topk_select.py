"""Exact top-k selection without a sort: a radix threshold select (docs/design.md §5.4).

The indexer keeps, for each query row, the K best-scoring visible entries, −1 padded when fewer
are visible (`dsv41_jax.layers.indexer.select_topk`, through `lax.top_k`, a full sort of each row
on the GPU). The selected *set* needs no sort, only the K-th largest value:

  key(x)   = the float32 bits mapped to uint32 so that key order is the total order of the floats
             (−0.0 below +0.0, as `lax.top_k` orders them); invisible entries get key 0
  τ        = the K-th largest key of the row (K = min(k, visible)), found a 4-bit digit at a time
             from the top: 8 passes, each a 16-bin count of the digit over the entries that match
             the digits found so far (one fused compare-and-count reduction per pass)
  selected = visible ∧ (key > τ  ∨  (key == τ  ∧  fewer than `need` equal keys before it))
  slot s   = the first entry whose running count of selected entries reaches s + 1

so ties at τ go to the lowest indices, `lax.top_k`'s rule, and the set equals its set. The
selected indices are written in ascending index order (not by score): every consumer (attention,
`scores_at_topk`, the KL loss) treats a row of top-k as a set. They carry the remat name
`pallas_kernels.ops.indexer.SELECTION`, so layer remat keeps them rather than select again.

Pure jax (XLA): the passes read the scores 8 times instead of sorting them. Not yet timed on the
GPU (`benchmarks/csa2_kernels_gpu.py --cases topk-4k` compares it with `lax.top_k`).

`score_and_select` is a kernel of the op `indexer_topk`: the op's XLA scores, visibility and pool
with this selection in place of `lax.top_k` (the Triton indexer kernel, `pallas_kernels.indexer`,
selects with `radix_topk` too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.ops import indexer as _ops

_U32 = jnp.uint32


def ordered_keys(x: jax.Array) -> jax.Array:
  """uint32 keys of float32 values, in the floats' total order (−0.0 < +0.0)."""
  b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), _U32)
  return jnp.where((b >> 31) == 1, ~b, b | _U32(0x80000000))


def radix_topk(scores_BxTxN: jax.Array, visible_BxTxN: jax.Array, k: int) -> jax.Array:
  """topk_BxTxK int32 (K = min(k, N)): the set `lax.top_k` selects among the visible entries,
  ascending, −1 in the slots past the number of visible entries."""
  n = scores_BxTxN.shape[-1]
  k_eff = min(k, n)
  keys = jnp.where(visible_BxTxN, ordered_keys(jax.lax.stop_gradient(scores_BxTxN)), _U32(0))
  need = jnp.minimum(jnp.sum(visible_BxTxN, axis=-1, dtype=jnp.int32), k_eff)   # [B, T]
  prefix = jnp.zeros(need.shape, _U32)
  bins = jnp.arange(16, dtype=_U32)
  for shift in range(28, -4, -4):                                    # the 8 digits, top first
    digit = (keys >> shift) & _U32(15)
    if shift == 28:
      match = jnp.ones(keys.shape, bool)
    else:
      match = (keys >> (shift + 4)) == (prefix >> (shift + 4))[..., None]
    counts = jnp.sum(match[..., None] & (digit[..., None] == bins), axis=-2, dtype=jnp.int32)
    at_or_above = jnp.cumsum(counts[..., ::-1], axis=-1)[..., ::-1]  # [B, T, 16]: digit ≥ b
    v = jnp.sum(at_or_above >= need[..., None], axis=-1, dtype=jnp.int32) - 1
    v = jnp.maximum(v, 0)
    above = jnp.take_along_axis(at_or_above, v[..., None], -1)[..., 0] - jnp.take_along_axis(
        counts, v[..., None], -1)[..., 0]
    need = jnp.where(need > 0, need - above, 0)
    prefix = prefix | (v.astype(_U32) << shift)
  tau = prefix[..., None]
  tie = (keys == tau) & visible_BxTxN
  ties_before = jnp.cumsum(tie, axis=-1, dtype=jnp.int32) - tie
  selected = visible_BxTxN & ((keys > tau) | (tie & (ties_before < need[..., None])))
  # Slot s holds the (s+1)-th selected entry: the first n whose running count reaches s + 1, a
  # binary search of each row's running count (no scatter); n = N past the row's count.
  count = jnp.cumsum(selected, axis=-1, dtype=jnp.int32)
  wanted = jnp.arange(1, k_eff + 1, dtype=jnp.int32)
  find = lambda c: jnp.searchsorted(c, wanted, side="left").astype(jnp.int32)
  idx = jax.vmap(jax.vmap(find))(count)
  return checkpoint_name(jnp.where(idx < n, idx, -1), _ops.SELECTION)


def select_topk(scores_BxTxN, visible_BxTxN, k: int, candidate_mask_BxTxN=None):
  """`pallas_kernels.ops.indexer.select_topk` (its signature, results and selected sets) through
  `radix_topk`: the slots hold the set in ascending index order, not by score."""
  mask = visible_BxTxN if candidate_mask_BxTxN is None else visible_BxTxN & candidate_mask_BxTxN
  topk = radix_topk(scores_BxTxN, mask, k)
  picked = jnp.take_along_axis(scores_BxTxN.astype(jnp.float32), jnp.maximum(topk, 0), axis=-1)
  return topk, jnp.where(topk >= 0, picked, 0.0)


def score_and_select(*args, **kwargs):
  """The op `indexer_topk` (`pallas_kernels.ops.indexer.score_and_select`, its arguments and
  results) selecting with `radix_topk`."""
  return _ops.score_and_select(*args, **kwargs, select=select_topk)
