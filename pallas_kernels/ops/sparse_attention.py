"""Op: one softmax over the sliding window and the selected compressed entries, with a sink (docs/design.md §4.3, §14).

For query t and head h the key set is the union of
  * the window: row positions j with t − W + 1 ≤ j ≤ t (W keys including t itself) in t's document
    (same `segment_id`, and padding, segment 0, sees nothing), and
  * the selected compressed entries I_t: the non-negative slots of `topk_BxTxK` (−1 = empty).
With s_{t,j} = (q_t · k_j)·scale, M = max(max_j s_{t,j}, sink_h),
  p_{t,j} = exp(s_{t,j} − M) / (Σ_j exp(s_{t,j} − M) + exp(sink_h − M)),   o_t = Σ_j p_{t,j} k_j
(K = V: multi-query attention over one latent). The sink takes probability mass without a value.

The window part is computed block-locally: queries in a block of S = min(W, T) rows attend to their
own key block and the P = ⌈(W − 1)/S⌉ previous ones, so the cost is O(T·W), never O(T²). The global
part has two forms of the same function (docs/design.md §T7): "masked" scores all N entries and masks to
the selected set (fast at moderate T), "gather" gathers the k selected entries per query
([B, T, K, D]; memory-bound, but linear in N). Both require the valid slots of a row of `topk` to be
distinct (as `lax.top_k` produces them): "masked" counts a repeated entry once, "gather" twice.
Either form holds a [B, T, H, N] or [B, T, K, D] intermediate; `query_chunk` bounds that at long T by
scanning over chunks of query rows (rematerialised in the backward pass). `attend` is the reference
of the dispatcher's op `sparse_attention`; its kernel `pallas_kernels.csa2_attention.sparse_attend`
runs one online softmax per query over the window and the selected entries read by index, neither
intermediate in memory (it counts a repeated slot twice, like "gather"), with a deterministic
backward.

`attend_reference` is the same function written densely over all T + N keys, for tests.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

_F32 = jnp.float32
# The name a kernel gives its forward's results (`jax.ad_checkpoint.checkpoint_name`: the output,
# the log-sum-exp its backward reads, global_probs), so that layer remat can keep them
# (`dsv41_jax.model.remat_policy`) instead of running the forward kernel again in the backward.
OUTPUT = "sparse_attention_output"
# Score of a masked key. Finite (exp(−1e30 − M) is exactly 0 for any finite M ≥ sink), so no −inf
# reaches the exponent: on CPU, exp of −inf runs a slow path (the masked forward took twice as long).
_MASKED = -1e30


def swa_visible(segment_ids_BxT: jax.Array, window: int) -> jax.Array:
  """Bool [B, T, T]: key j visible to query t (docs/design.md §14). Dense; for references and small T."""
  t = jnp.arange(segment_ids_BxT.shape[1])
  delta = t[:, None] - t[None, :]
  in_window = (delta >= 0) & (delta < window)
  seg = segment_ids_BxT
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  return same & in_window[None]


def selected_mask(topk_BxTxK: jax.Array, n_entries: int) -> jax.Array:
  """Bool [B, T, N]: entry n is among the valid (≥ 0) slots of topk[b, t]."""
  idx = jnp.where(topk_BxTxK >= 0, topk_BxTxK, n_entries)  # empty slots land in a dropped column
  row = lambda i: jnp.zeros((n_entries + 1,), bool).at[i].set(True)[:n_entries]
  return jax.vmap(jax.vmap(row))(idx)


def _blocks(x, S: int, P: int):
  """[B, nb·S, ...] → [B, nb, (P+1)·S, ...]: each block with the P blocks before it (zeros before row 0)."""
  B, Tp = x.shape[:2]
  nb = Tp // S
  xb = x.reshape(B, nb, S, *x.shape[2:])
  shifted = []
  for p in range(P, -1, -1):
    pad = jnp.zeros((B, p) + xb.shape[2:], xb.dtype)
    shifted.append(jnp.concatenate([pad, xb[:, :nb - p]], axis=1))
  return jnp.concatenate(shifted, axis=2)


def attend(q_BxTxHxD: jax.Array, swa_kv_BxTxD: jax.Array, segment_ids_BxT: jax.Array,
           sink_H: jax.Array, global_kv_BxNxD: jax.Array | None = None,
           topk_BxTxK: jax.Array | None = None, *, window: int, scale: float,
           impl: str = "masked", query_chunk: int | None = None
           ) -> tuple[jax.Array, jax.Array | None]:
  """Sparse attention with sink; returns (o_BxTxHxD in q's dtype, global_probs_BxTxK or None).

  `global_probs_BxTxK` (fp32) is the probability each selected slot received, summed over heads,
  0 for empty slots: the target of the indexer KL loss (the caller stops its gradient).
  Scores and sums are fp32; the products take the inputs' dtype.

  `query_chunk` (rows, rounded down to whole blocks of S = min(window, T)): process the queries in
  chunks of that many rows, one after another, each rematerialised in the backward pass, so the
  largest intermediate is [B, chunk, H, N] ("masked") or [B, chunk, K, D] ("gather") instead of
  the whole row. None = one chunk. The result does not depend on it.

  `impl` is the XLA form ("masked" or "gather", module doc).
  """
  if impl not in ("masked", "gather"):
    raise ValueError(f"impl must be 'masked' or 'gather' (got {impl!r})")
  if (global_kv_BxNxD is None) != (topk_BxTxK is None):
    raise ValueError("global_kv_BxNxD and topk_BxTxK must be given together")
  B, T, H, D = q_BxTxHxD.shape
  S = min(window, T)
  nb = -(-T // S)
  c = nb if query_chunk is None else max(1, min(nb, query_chunk // S))   # blocks per chunk
  nb = -(-nb // c) * c
  P = min(-(-(window - 1) // S), nb - 1)
  Tp = nb * S

  def padded(x, value=0):  # [B, T, ...] → [B, Tp, ...]
    return jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

  def blocked(x, value=0):  # [B, T, ...] → [B, nb, S, ...]
    return padded(x, value).reshape(B, nb, S, *x.shape[2:])

  xs = dict(q=blocked(q_BxTxHxD), seg_q=blocked(segment_ids_BxT),       # [B, nb, S, ...]
            k=_blocks(padded(swa_kv_BxTxD), S, P),                      # [B, nb, L, D]
            seg_k=_blocks(padded(segment_ids_BxT), S, P))               # [B, nb, L]
  if topk_BxTxK is not None:
    xs["topk"] = blocked(topk_BxTxK, -1)                            # [B, nb, S, K]
  core = partial(_attend_blocks, sink=sink_H.astype(_F32), global_kv=global_kv_BxNxD,
                 window=window, scale=scale, impl=impl, P=P)
  if c == nb:
    o, probs = core(xs)
  else:  # chunks of c blocks, scanned
    xs = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(B, nb // c, c, *x.shape[2:]), 1, 0), xs)
    o, probs = jax.lax.map(jax.checkpoint(core), xs)
    o = jnp.moveaxis(o, 0, 1)
    probs = None if probs is None else jnp.moveaxis(probs, 0, 1)
  o = o.reshape(B, Tp, H, D)[:, :T]
  return o, (None if probs is None else probs.reshape(B, Tp, -1)[:, :T])


def _attend_blocks(xs, *, sink, global_kv, window: int, scale: float, impl: str, P: int):
  """`attend` on c blocks of S query rows: xs["q"] [B, c, S, H, D], xs["k"] [B, c, L, D] (each
  block's own and P previous key blocks), segments, and optionally xs["topk"] [B, c, S, K].
  Returns (o [B, c, S, H, D], probs [B, c, S, K] or None)."""
  q_blk, k_blk, seg_q, seg_k = xs["q"], xs["k"], xs["seg_q"], xs["seg_k"]
  B, c, S, H, D = q_blk.shape
  L = k_blk.shape[2]
  R = c * S                                                         # query rows in this chunk
  q = q_blk.reshape(B, R, H, D)

  # --- window: block-local scores [B, c, S, H, L] -------------------------------------------
  delta = jnp.arange(S)[:, None] + P * S - jnp.arange(L)[None, :]   # t − j inside a block
  in_window = (delta >= 0) & (delta < window)                       # [S, L]
  vis = (in_window & (seg_q[..., :, None] == seg_k[..., None, :])
         & (seg_q[..., :, None] > 0))                               # [B, c, S, L]
  s_swa = jnp.einsum("bnshd,bnld->bnshl", q_blk, k_blk, preferred_element_type=_F32) * scale
  s_swa = jnp.where(vis[:, :, :, None, :], s_swa, _MASKED)
  m = jnp.maximum(jnp.max(s_swa, axis=-1).reshape(B, R, H), sink)   # [B, R, H]

  # --- global: scores over the selected entries ----------------------------------------------
  if global_kv is not None:
    N = global_kv.shape[1]
    topk = xs["topk"].reshape(B, R, -1)
    valid = topk >= 0                                               # [B, R, K]
    if impl == "masked":
      v = global_kv
      sel = selected_mask(topk, N)                                  # [B, R, N]
      s_glob = jnp.einsum("bthd,bnd->bthn", q, v, preferred_element_type=_F32) * scale
      s_glob = jnp.where(sel[:, :, None, :], s_glob, _MASKED)
    else:
      v = jax.vmap(lambda kv_b, i_b: kv_b[i_b])(global_kv, jnp.maximum(topk, 0))  # [B, R, K, D]
      s_glob = jnp.einsum("bthd,btkd->bthk", q, v, preferred_element_type=_F32) * scale
      s_glob = jnp.where(valid[:, :, None, :], s_glob, _MASKED)
    m = jnp.maximum(m, jnp.max(s_glob, axis=-1))
  m = jax.lax.stop_gradient(m)  # the softmax is invariant to the shift; keep its gradient simple

  # --- one normaliser: window + global + sink -------------------------------------------------
  # The exponentials are rounded once to the values' dtype and both the numerator and the
  # denominator sum those rounded values (fp32 accumulation): the normalisation stays consistent,
  # and in bf16 the [.., H, N] tensors kept for the backward take half the memory.
  e_swa = jnp.exp(s_swa - m.reshape(B, c, S, H)[..., None]).astype(k_blk.dtype)
  denom = jnp.sum(e_swa, axis=-1, dtype=_F32).reshape(B, R, H) + jnp.exp(sink - m)
  acc = jnp.einsum("bnshl,bnld->bnshd", e_swa, k_blk, preferred_element_type=_F32)
  acc = acc.reshape(B, R, H, D)
  probs = None
  if global_kv is not None:
    e_glob = jnp.exp(s_glob - m[..., None]).astype(v.dtype)         # [B, R, H, N or K]
    denom = denom + jnp.sum(e_glob, axis=-1, dtype=_F32)
    if impl == "masked":
      acc = acc + jnp.einsum("bthn,bnd->bthd", e_glob, v, preferred_element_type=_F32)
      # global_probs reads the K selected columns only, not all N.
      e_glob = jnp.take_along_axis(e_glob, jnp.maximum(topk, 0)[:, :, None, :], axis=-1)
    else:
      acc = acc + jnp.einsum("bthk,btkd->bthd", e_glob, v, preferred_element_type=_F32)
    p_glob = jnp.sum(e_glob.astype(_F32) / denom[..., None], axis=2)  # [B, R, K]
    probs = jnp.where(valid, p_glob, 0.0).reshape(B, c, S, -1)
  o = (acc / denom[..., None]).astype(q_blk.dtype).reshape(B, c, S, H, D)
  return o, probs


def attend_reference(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT, sink_H, *, window: int, scale: float,
                     global_kv_BxNxD=None, topk_BxTxK=None):
  """`attend` written densely over all T window candidates and all N entries (fp32 throughout)."""
  q = q_BxTxHxD.astype(_F32)
  keys = swa_kv_BxTxD.astype(_F32)
  vis = swa_visible(segment_ids_BxT, window)                        # [B, T, T]
  if global_kv_BxNxD is not None:
    N = global_kv_BxNxD.shape[1]
    onehot = (topk_BxTxK[..., None] == jnp.arange(N)) & (topk_BxTxK[..., None] >= 0)  # [B,T,K,N]
    vis = jnp.concatenate([vis, jnp.any(onehot, axis=2)], axis=-1)
    keys = jnp.concatenate([keys, global_kv_BxNxD.astype(_F32)], axis=1)
  s = jnp.einsum("bthd,bjd->bthj", q, keys, precision="highest") * scale
  s = jnp.where(vis[:, :, None, :], s, -jnp.inf)
  sink = sink_H.astype(_F32)
  m = jnp.maximum(jnp.max(s, axis=-1), sink)
  e = jnp.exp(s - m[..., None])
  p = e / (jnp.sum(e, axis=-1) + jnp.exp(sink - m))[..., None]
  o = jnp.einsum("bthj,bjd->bthd", p, keys, precision="highest").astype(q_BxTxHxD.dtype)
  if global_kv_BxNxD is None:
    return o, None
  T = q.shape[1]
  p_ent = jnp.sum(p[..., T:], axis=2)                               # [B, T, N]
  probs = jnp.einsum("btkn,btn->btk", onehot.astype(_F32), p_ent, precision="highest")
  return o, probs


def default_scale(head_dim: int) -> float:
  """D^{-1/2}, with no YaRN mscale (docs/design.md §4.3)."""
  return 1.0 / math.sqrt(head_dim)
