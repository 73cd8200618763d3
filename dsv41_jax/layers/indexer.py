"""CSA2 lightning indexer: scores, top-k, candidate pool and its KL loss (docs/design.md §5.3–5.6, §14).

Shapes (H_I index heads of width D_I, N compressed entries, K = `index_topk`):

  keys (Full layers):   latent_BxNxC ─sg─▶ ·wk ─▶ RMSNorm_w ─▶ RoPE(entry_pos) ─▶ [MXFP4] ─▶ k_BxNxI
  query:                c_q_BxTxQ ─sg─▶ ·wq_b ─▶ q_BxTxHxI ─▶ RoPE(position) ─▶ [MXFP4]
  weights:              x_BxTxD ─sg─▶ ·weights_proj ─▶ w_BxTxH · H_I^{-1/2}
  scores:               I_BxTxN = Σ_h w · ReLU(q·k) · D_I^{-1/2}, masked by causal + document
                        visibility (`types.entry_visible`) and, at a candidate consumer, the pool
  top-k:                topk_BxTxK (int32, −1 where fewer entries are visible), I at those slots

`sg` is stop_gradient: the LM loss never trains the indexer (top-k has no gradient) and the
indexer KL loss (§5.5) never trains the backbone; it reaches only wq_b, weights_proj, wk, k_norm.

Modes (§5.5): a Full layer owns `wk`/`k_norm` and publishes index_k; a Reindex layer scores its
own q/w against the shared index_k; Reuse layers have no indexer. The candidate pool (§5.6) is
kept compactly as selected block ids [B, T, n_blocks] and expanded to a mask by each consumer.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from dsv41_jax import quant, sharding
from dsv41_jax.layers import norm, rope
from dsv41_jax.layers.types import CompressedKV, entry_visible


# --- pure math -----------------------------------------------------------------------------------

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


def empty_candidate(cfg, b: int, t: int, n: int) -> jax.Array:
  """A pool that selects nothing, shaped like `candidate_pool`'s output for N = n entries."""
  nb = -(-n // cfg.candidate_block_size)
  return jnp.full((b, t, min(cfg.candidate_topk_blocks, nb)), -1, jnp.int32)


def candidate_mask(block_ids_BxTxK: jax.Array, n: int, block_size: int) -> jax.Array:
  """Expand selected block ids (−1 = none) to the entry mask bool [B, T, n] a consumer applies."""
  nb = -(-n // block_size)
  ids = jnp.where(block_ids_BxTxK < 0, nb, block_ids_BxTxK)        # −1 → a spill slot
  one_row = lambda i: jnp.zeros((nb + 1,), jnp.bool_).at[i].set(True)
  blocks_BxTxNb = jax.vmap(jax.vmap(one_row))(ids)[..., :nb]
  return jnp.repeat(blocks_BxTxNb, block_size, axis=-1)[..., :n]


def indexer_kl_loss(scores_at_topk_BxTxK: jax.Array, topk_BxTxK: jax.Array,
                    attn_mass_BxTxK: jax.Array, token_mask_BxT: jax.Array) -> jax.Array:
  """Sparse-stage indexer loss (docs/design.md §5.1, §5.5): mean_t KL(p_t ‖ softmax(I_t restricted to S_t)).

  S_t = the selected slots (topk ≥ 0); p_t = the main attention mass on them (summed over heads)
  L1-normalised over S_t and detached. The mean runs over real query tokens (`token_mask`) with at
  least one selected entry; 0 when there are none.
  """
  sel = topk_BxTxK >= 0
  p = jnp.where(sel, jax.lax.stop_gradient(attn_mass_BxTxK).astype(jnp.float32), 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
  s = jnp.where(sel, scores_at_topk_BxTxK.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  log_q = jax.nn.log_softmax(s, axis=-1)
  log_p = jnp.log(jnp.where(p > 0, p, 1.0))
  kl_BxT = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
  rows = (token_mask_BxT > 0) & jnp.any(sel, axis=-1)
  return jnp.sum(jnp.where(rows, kl_BxT, 0.0)) / jnp.maximum(jnp.sum(rows), 1)


# --- module -------------------------------------------------------------------------------------

class Indexer(nnx.Module):
  """One Full or Reindex layer's indexer: `wq_b`, `weights_proj` and (Full only) `wk`, `k_norm`.

  `query_chunk` bounds memory: queries are scored and selected in chunks of that many rows (a
  checkpointed `lax.map`), so the [chunk, H_I, N] logits, not [T, H_I, N], are live at once. On
  the H200 the chunk size barely changes the time (benchmarks/RESULTS.md, "CSA2 indexer"), so
  the default is small: 512 rows keep the backward's temporaries at ~2 GiB for N = 16K entries.
  With `cfg.kernels == "pallas"` the scores and top-k run in `pallas_kernels.indexer` (see
  `score_and_select`).
  """

  def __init__(self, cfg, spec, rngs: nnx.Rngs, *, query_chunk: int = 512):
    if spec.mode not in ("full", "reindex"):
      raise ValueError(f"layer {spec.index} is a {spec.mode} layer; only Full and Reindex layers "
                       "own an indexer")
    self.mode = spec.mode
    self.candidate_role = spec.candidate_role
    self.n_heads = cfg.index_n_heads
    self.topk = cfg.index_topk
    self.block_size = cfg.candidate_block_size
    self.topk_blocks = cfg.candidate_topk_blocks
    self.fp4 = bool(cfg.fp4_indexer)
    self.query_chunk = int(query_chunk)
    self.kernels = cfg.kernels
    if self.kernels == "pallas" and (reason := pallas_kernels.backend_reason()) is not None:
      raise ValueError(f"kernels='pallas': {reason}")
    self.inv_freq = tuple(float(f) for f in rope.layer_inv_freq(cfg, spec))
    pdt = jnp.dtype(cfg.param_dtype)
    init = sharding.fan_in_normal((0,))
    self.wq_b = sharding.param(rngs, (cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim),
                               ("q_lora", "index_heads", "index_dim"), init, pdt)
    self.weights_proj = sharding.param(rngs, (cfg.hidden_size, cfg.index_n_heads),
                                       ("embed", "index_heads"), init, pdt)
    if spec.owns_compressor:
      self.wk = sharding.param(rngs, (cfg.head_dim, cfg.index_head_dim), ("kv", "index_dim"),
                               init, pdt)
      self.k_norm = norm.RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, rngs, param_dtype=pdt)

  def _quant(self, a):
    return quant.fake_quant(a, quant.mxfp4) if self.fp4 else a

  def keys(self, latent_BxNxC: jax.Array, entry_pos_BxN: jax.Array,
           inv_freq=None) -> jax.Array:
    """index_k_BxNxI from the compressor's pre-RoPE latent (Full layers, docs/design.md §5.3)."""
    if self.mode != "full":
      raise ValueError("indexer keys come from the Full layer; a Reindex layer uses the shared "
                       "CompressedKV.index_k_BxNxI")
    inv_freq = self.inv_freq if inv_freq is None else inv_freq
    latent = jax.lax.stop_gradient(latent_BxNxC)
    k = jnp.einsum("bnc,ci->bni", latent, self.wk[...].astype(latent.dtype))
    k = rope.apply_rope(self.k_norm(k), entry_pos_BxN, np.asarray(inv_freq))
    return self._quant(k).astype(latent.dtype)

  def __call__(self, x_BxTxD: jax.Array, c_q_BxTxQ: jax.Array, *, positions: jax.Array,
               segment_ids: jax.Array, kv: CompressedKV, candidate: jax.Array | None = None,
               inv_freq=None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(topk_BxTxK, scores_at_topk_BxTxK, candidate_out).

    `candidate` (consumers) / `candidate_out` (the source) are block ids [B, T, n_blocks];
    `candidate_out` is None unless this layer is the candidate source.
    """
    if self.candidate_role == "consumer" and candidate is None:
      raise ValueError("a candidate consumer needs the source layer's candidate pool "
                       "(docs/design.md §5.6)")
    inv_freq = np.asarray(self.inv_freq if inv_freq is None else inv_freq)
    c_q = jax.lax.stop_gradient(c_q_BxTxQ)
    x = jax.lax.stop_gradient(x_BxTxD)
    q = jnp.einsum("btq,qhi->bthi", c_q, self.wq_b[...].astype(c_q.dtype))
    q = self._quant(rope.apply_rope(q, positions, inv_freq))
    w = jnp.einsum("btd,dh->bth", x, self.weights_proj[...].astype(x.dtype))
    w = w.astype(jnp.float32) * (self.n_heads ** -0.5)
    cand_in = candidate if self.candidate_role == "consumer" else None
    return score_and_select(q, w, kv, segment_ids, k=self.topk, candidate=cand_in,
                            make_pool=self.candidate_role == "source",
                            block_size=self.block_size, topk_blocks=self.topk_blocks,
                            query_chunk=self.query_chunk, kernels=self.kernels)


def score_and_select(q_BxTxHxI, w_BxTxH, kv: CompressedKV, segment_ids_BxT, *, k: int,
                     candidate=None, make_pool: bool = False, block_size: int = 8,
                     topk_blocks: int = 1, query_chunk: int | None = None, kernels: str = "xla"):
  """Scores, visibility, optional pool, top-k for all queries, `query_chunk` rows at a time.

  Returns (topk_BxTxK, scores_at_topk_BxTxK, pool_block_ids or None). Chunking changes memory,
  never results. kernels="pallas": the scores and top-k come from the kernel
  (`pallas_kernels.indexer`, never the [rows, H_I, N] logits) and scores_at_topk from the k
  selected entries; the candidate pool and shapes the kernel cannot take run here, after a
  one-time log line.
  """
  if kernels == "pallas":
    reason = ("the candidate pool (docs/design.md §5.6) has no kernel"
              if make_pool or candidate is not None
              else pallas_kernels.unsupported("indexer_score_and_select", q_BxTxHxI, kv.index_k_BxNxI))
    if reason is None:
      topk, picked = pallas_kernels.kernel("indexer_score_and_select")(
          q_BxTxHxI, w_BxTxH, kv.index_k_BxNxI, kv.entry_segment_BxN, kv.entry_last_BxN,
          segment_ids_BxT, k=k, query_chunk=query_chunk)
      return topk, picked, None
    pallas_kernels.note_fallback("indexer_score_and_select", reason)
  b, t = segment_ids_BxT.shape
  n = kv.index_k_BxNxI.shape[1]

  def one(q, w, seg, rows, cand):
    scores = indexer_scores(q, kv.index_k_BxNxI, w)
    vis = entry_visible(kv, seg, rows)
    pool = candidate_pool(scores, vis, block_size, topk_blocks) if make_pool else None
    cmask = None if cand is None else candidate_mask(cand, n, block_size)
    topk, picked = select_topk(scores, vis, k, cmask)
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
