"""Op: the CSA2 lightning indexer's scores, visibility, candidate pool and top-k (docs/design.md §5.2–5.6, §14).

Shapes: H_I index heads of width D_I, N compressed entries, K = `index_topk`.

  scores:     I_BxTxN = Σ_h w · ReLU(q·k) · D_I^{-1/2}                       (`indexer_scores`)
  visible:    entry n complete by t and inside t's document                  (`entry_visible`)
  pool:       the best `topk_blocks` blocks of `block_size` entries (§5.6)   (`candidate_pool`)
  top-k:      topk_BxTxK (int32, −1 where fewer entries are selectable) and I at those slots

`score_and_select` is all of it for a whole row, `query_chunk` rows at a time: the reference of
the dispatcher's op `indexer_topk`, whose kernel (`pallas_kernels/indexer.py`) never writes the
[rows, H_I, N] logits. The model's `Indexer` (`dsv41_jax/layers/indexer.py`) holds the weights,
computes q, w and the keys, and calls the op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The name a kernel gives the selection it makes without `lax.top_k` (`jax.ad_checkpoint.
# checkpoint_name`), so that layer remat can keep it as it keeps `top_k`'s outputs
# (`dsv41_jax.model.remat_policy`) instead of selecting again in the backward; the indexer kernel
# gives it to the scores at the selection too ([B, T, K] float32, which the KL loss's backward
# reads: kept, `scores_at`'s forward kernel does not run again in the remat pass).
SELECTION = "indexer_selection"


def entry_visible(entry_segment_BxN: jax.Array, entry_last_BxN: jax.Array,
                  segment_ids_BxT: jax.Array, query_rows_T: jax.Array | None = None) -> jax.Array:
  """Bool [B, T, N]: compressed entry g is visible to query t (docs/design.md §5.2 causality + §14).

  Visible iff the group is complete by t, (g+1)·m − 1 ≤ t (`entry_last`), and all of its tokens
  lie in t's document (`entry_segment`; padding, segment 0, sees nothing). `query_rows_T` gives
  the row index of each query when the queries are a chunk of the row (default: rows 0 … T−1).
  """
  t = (jnp.arange(segment_ids_BxT.shape[1], dtype=jnp.int32) if query_rows_T is None
       else query_rows_T.astype(jnp.int32))
  complete = entry_last_BxN[:, None, :] <= t[None, :, None]
  same_doc = entry_segment_BxN[:, None, :] == segment_ids_BxT[:, :, None]
  return complete & same_doc & (segment_ids_BxT[:, :, None] > 0)


def indexer_scores(q_BxTxHxI: jax.Array, k_BxNxI: jax.Array, w_BxTxH: jax.Array) -> jax.Array:
  """I_BxTxN = Σ_h w_{t,h} · ReLU(q_{t,h} · k_n) · D_I^{-1/2}, in float32 (docs/design.md §5.4)."""
  d_i = q_BxTxHxI.shape[-1]
  logits_BxTxHxN = jnp.einsum("bthi,bni->bthn", q_BxTxHxI, k_BxNxI,
                              preferred_element_type=jnp.float32)
  return jnp.einsum("bthn,bth->btn", jax.nn.relu(logits_BxTxHxN),
                    w_BxTxH.astype(jnp.float32)) * (d_i ** -0.5)


def select_topk(scores_BxTxN: jax.Array, visible_BxTxN: jax.Array, k: int,
                candidate_mask_BxTxN: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(topk_BxTxK int32, scores_at_topk_BxTxK float32) over the visible (and candidate) entries.

  K = min(k, N). Slots past the number of selectable entries hold index −1 and score 0. The
  indices carry no gradient; `scores_at_topk` is differentiable in `scores_BxTxN`.
  """
  mask = visible_BxTxN if candidate_mask_BxTxN is None else visible_BxTxN & candidate_mask_BxTxN
  n = scores_BxTxN.shape[-1]
  k_eff = min(k, n)
  masked = jnp.where(mask, jax.lax.stop_gradient(scores_BxTxN).astype(jnp.float32), -jnp.inf)
  _, idx = jax.lax.top_k(masked, k_eff)
  valid = jnp.arange(k_eff) < jnp.sum(mask, axis=-1, dtype=jnp.int32)[..., None]
  topk = jnp.where(valid, idx, -1).astype(jnp.int32)
  picked = jnp.take_along_axis(scores_BxTxN.astype(jnp.float32), idx, axis=-1)
  return topk, jnp.where(valid, picked, 0.0)


def candidate_pool(scores_BxTxN: jax.Array, visible_BxTxN: jax.Array, block_size: int,
                   topk_blocks: int) -> jax.Array:
  """Selected candidate blocks [B, T, min(topk_blocks, ⌈N/bs⌉)] int32, −1 padded (docs/design.md §5.6).

  Block score = max of the visible scores in each `block_size`-entry block (entries padded to a
  multiple of the block); the block holding the newest visible entry is pinned to +∞ so it is
  always in the pool; blocks with no visible entry are never chosen.
  """
  b, t, n = scores_BxTxN.shape
  nb = -(-n // block_size)
  pad = nb * block_size - n
  s = jnp.where(visible_BxTxN, jax.lax.stop_gradient(scores_BxTxN).astype(jnp.float32), -jnp.inf)
  s = jnp.pad(s, [(0, 0), (0, 0), (0, pad)], constant_values=-jnp.inf)
  vis = jnp.pad(visible_BxTxN, [(0, 0), (0, 0), (0, pad)])
  block_BxTxNb = jnp.max(s.reshape(b, t, nb, block_size), axis=-1)
  has_BxTxNb = jnp.any(vis.reshape(b, t, nb, block_size), axis=-1)
  newest = jnp.max(jnp.where(vis, jnp.arange(nb * block_size), -1), axis=-1) // block_size
  block_BxTxNb = jnp.where(jnp.arange(nb) == newest[..., None], jnp.inf, block_BxTxNb)
  kb = min(topk_blocks, nb)
  _, ids = jax.lax.top_k(block_BxTxNb, kb)
  valid = jnp.arange(kb) < jnp.sum(has_BxTxNb, axis=-1, dtype=jnp.int32)[..., None]
  return jnp.where(valid, ids, -1).astype(jnp.int32)


def candidate_mask(block_ids_BxTxK: jax.Array, n: int, block_size: int) -> jax.Array:
  """Expand selected block ids (−1 = none) to the entry mask bool [B, T, n] a consumer applies."""
  nb = -(-n // block_size)
  ids = jnp.where(block_ids_BxTxK < 0, nb, block_ids_BxTxK)        # −1 → a spill slot
  one_row = lambda i: jnp.zeros((nb + 1,), jnp.bool_).at[i].set(True)
  blocks_BxTxNb = jax.vmap(jax.vmap(one_row))(ids)[..., :nb]
  return jnp.repeat(blocks_BxTxNb, block_size, axis=-1)[..., :n]


def score_and_select(q_BxTxHxI, w_BxTxH, index_k_BxNxI, entry_segment_BxN, entry_last_BxN,
                     segment_ids_BxT, candidate=None, *, k: int, make_pool: bool = False,
                     block_size: int = 8, topk_blocks: int = 1, query_chunk: int | None = None,
                     select=select_topk):
  """Scores, visibility, optional pool, top-k for all queries, `query_chunk` rows at a time.

  `candidate`: a consumer's pool block ids [B, T, n_blocks] (−1 = none), or None; `make_pool`:
  this layer is the pool's source. Returns (topk_BxTxK, scores_at_topk_BxTxK, pool block ids or
  None). Chunking changes memory, never results. `select`: the selection, `select_topk`'s
  signature and selected sets (a kernel passes its own exact form, `pallas_kernels.topk_select`).
  """
  b, t = segment_ids_BxT.shape
  n = index_k_BxNxI.shape[1]

  def one(q, w, seg, rows, cand):
    scores = indexer_scores(q, index_k_BxNxI, w)
    vis = entry_visible(entry_segment_BxN, entry_last_BxN, seg, rows)
    pool = candidate_pool(scores, vis, block_size, topk_blocks) if make_pool else None
    cmask = None if cand is None else candidate_mask(cand, n, block_size)
    topk, picked = select(scores, vis, k, cmask)
    return topk, picked, pool

  rows = jnp.arange(t, dtype=jnp.int32)
  c = t if not query_chunk or query_chunk >= t else int(query_chunk)
  if c == t:
    return one(q_BxTxHxI, w_BxTxH, segment_ids_BxT, rows, candidate)
  nc = -(-t // c)
  pad = nc * c - t

  def chunks(a, fill=0):
    if a is None:
      return None
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
    return jnp.moveaxis(a.reshape(b, nc, c, *a.shape[2:]), 1, 0)

  xs = (chunks(q_BxTxHxI), chunks(w_BxTxH), chunks(segment_ids_BxT),
        jnp.arange(nc * c, dtype=jnp.int32).reshape(nc, c), chunks(candidate, -1))
  body = jax.checkpoint(lambda a: one(*a))
  out = jax.lax.map(body, xs)

  def unchunk(a):
    if a is None:
      return None
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape(b, nc * c, *a.shape[3:])[:, :t]

  return tuple(unchunk(a) for a in out)
