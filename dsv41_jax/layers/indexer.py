"""CSA2 lightning indexer: weights, queries, keys and the KL loss (docs/design.md §5.3–5.6, §14).

Shapes (H_I index heads of width D_I, N compressed entries, K = `index_topk`):

  keys (Full layers):   latent_BxNxC ─sg─▶ ·wk ─▶ RMSNorm_w ─▶ RoPE(entry_pos) ─▶ [MXFP4] ─▶ k_BxNxI
  query:                c_q_BxTxQ ─sg─▶ ·wq_b ─▶ q_BxTxHxI ─▶ RoPE(position) ─▶ [MXFP4]
  weights:              x_BxTxD ─sg─▶ ·weights_proj ─▶ w_BxTxH · H_I^{-1/2}
  scores:               I_BxTxN = Σ_h w · ReLU(q·k) · D_I^{-1/2}, masked by causal + document
                        visibility (`entry_visible`) and, at a candidate consumer, the pool
  top-k:                topk_BxTxK (int32, −1 where fewer entries are visible), I at those slots

Scores, visibility, pool and top-k are the op `pallas_kernels.ops.indexer` (the dispatcher's
`indexer_topk`, reference or kernel under `cfg.ops.indexer_topk`); its functions are imported
here under their names. MXFP4 (§9.2) goes through the op `fake_quant_mxfp4`.

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

from dsv41_jax import sharding
from dsv41_jax.layers import norm, rope
from dsv41_jax.layers.types import CompressedKV
from pallas_kernels import dispatch
from pallas_kernels.ops.indexer import (  # noqa: F401  (the op's math, as the model names it)
    candidate_mask, candidate_pool, indexer_scores, select_topk)


def empty_candidate(cfg, b: int, t: int, n: int) -> jax.Array:
  """A pool that selects nothing, shaped like `candidate_pool`'s output for N = n entries."""
  nb = -(-n // cfg.candidate_block_size)
  return jnp.full((b, t, min(cfg.candidate_topk_blocks, nb)), -1, jnp.int32)


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
  Scores and top-k are the op `indexer_topk` under `cfg.ops.indexer_topk` (`score_and_select`).
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
    self.policies = cfg.ops
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

  def quantize(self, a: jax.Array) -> jax.Array:
    """MXFP4 fake quantization of q or k when `cfg.fp4_indexer` (the op `fake_quant_mxfp4`)."""
    if not self.fp4:
      return a
    return dispatch.call("fake_quant_mxfp4", a, policy=self.policies.fake_quant_mxfp4)

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
    return self.quantize(k).astype(latent.dtype)

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
    q, w = self.queries(x_BxTxD, c_q_BxTxQ, positions, inv_freq)
    return self.select(q, w, kv, segment_ids, candidate, query_chunk=self.query_chunk)

  def queries(self, x_BxTxD: jax.Array, c_q_BxTxQ: jax.Array, positions: jax.Array,
              inv_freq=None) -> tuple[jax.Array, jax.Array]:
    """(q_BxTxHxI, w_BxTxH): RoPE'd (and MXFP4) index queries and float32 head weights."""
    inv_freq = np.asarray(self.inv_freq if inv_freq is None else inv_freq)
    c_q = jax.lax.stop_gradient(c_q_BxTxQ)
    x = jax.lax.stop_gradient(x_BxTxD)
    q = jnp.einsum("btq,qhi->bthi", c_q, self.wq_b[...].astype(c_q.dtype))
    q = self.quantize(rope.apply_rope(q, positions, inv_freq))
    w = jnp.einsum("btd,dh->bth", x, self.weights_proj[...].astype(x.dtype))
    return q, w.astype(jnp.float32) * (self.n_heads ** -0.5)

  def select(self, q_BxTxHxI, w_BxTxH, kv: CompressedKV, segment_ids, candidate=None, *,
             query_chunk: int | None = None):
    """(topk, scores_at_topk, candidate_out) of these queries: the op `indexer_topk`."""
    cand_in = candidate if self.candidate_role == "consumer" else None
    return score_and_select(q_BxTxHxI, w_BxTxH, kv, segment_ids, k=self.topk, candidate=cand_in,
                            make_pool=self.candidate_role == "source",
                            block_size=self.block_size, topk_blocks=self.topk_blocks,
                            query_chunk=query_chunk, policy=self.policies.indexer_topk)


def score_and_select(q_BxTxHxI, w_BxTxH, kv: CompressedKV, segment_ids_BxT, *, k: int,
                     candidate=None, make_pool: bool = False, block_size: int = 8,
                     topk_blocks: int = 1, query_chunk: int | None = None,
                     policy: str = "reference"):
  """The op `indexer_topk` (`pallas_kernels.ops.indexer.score_and_select`) on a `CompressedKV`,
  under `policy`: (topk_BxTxK, scores_at_topk_BxTxK, pool block ids or None)."""
  return dispatch.call("indexer_topk", q_BxTxHxI, w_BxTxH, kv.index_k_BxNxI, kv.entry_segment_BxN,
                       kv.entry_last_BxN, segment_ids_BxT, candidate, policy=policy, k=k,
                       make_pool=make_pool, block_size=block_size, topk_blocks=topk_blocks,
                       query_chunk=query_chunk)
