"""One softmax over the sliding window and the selected compressed entries, with a sink (MODEL.md §4.3, §14).

For query t and head h the key set is the union of
  * the window: row positions j with t − W + 1 ≤ j ≤ t (W keys including t itself) in t's document
    (same `segment_id`, and padding, segment 0, sees nothing), and
  * the selected compressed entries I_t: the non-negative slots of `topk_BxTxK` (−1 = empty).
With s_{t,j} = (q_t · k_j)·scale, M = max(max_j s_{t,j}, sink_h),
  p_{t,j} = exp(s_{t,j} − M) / (Σ_j exp(s_{t,j} − M) + exp(sink_h − M)),   o_t = Σ_j p_{t,j} k_j
(K = V: multi-query attention over one latent). The sink takes probability mass without a value.

The window part is computed block-locally: queries in a block of S = min(W, T) rows attend to their
own key block and the P = ⌈(W − 1)/S⌉ previous ones, so the cost is O(T·W), never O(T²). The global
part has two forms of the same function (TRAINING.md §7): "masked" scores all N entries and masks to
the selected set (fast at moderate T), "gather" gathers the k selected entries per query
([B, T, K, D]; memory-bound, but linear in N). Both require the valid slots of a row of `topk` to be
distinct (as `lax.top_k` produces them): "masked" counts a repeated entry once, "gather" twice.

`attend_reference` is the same function written densely over all T + N keys, for tests.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_F32 = jnp.float32
# Score of a masked key. Finite (exp(−1e30 − M) is exactly 0 for any finite M ≥ sink), so no −inf
# reaches the exponent: on CPU, exp of −inf runs a slow path (the masked forward took twice as long).
_MASKED = -1e30


def swa_visible(segment_ids_BxT: jax.Array, window: int) -> jax.Array:
  """Bool [B, T, T]: key j visible to query t (MODEL.md §14). Dense; for references and small T."""
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
           sink_H: jax.Array, *, window: int, scale: float,
           global_kv_BxNxD: jax.Array | None = None, topk_BxTxK: jax.Array | None = None,
           impl: str = "masked") -> tuple[jax.Array, jax.Array | None]:
  """Sparse attention with sink; returns (o_BxTxHxD in q's dtype, global_probs_BxTxK or None).

  `global_probs_BxTxK` (fp32) is the probability each selected slot received, summed over heads,
  0 for empty slots: the target of the indexer KL loss (the caller stops its gradient).
  Scores, softmax and accumulation are fp32; the products take the inputs' dtype.
  """
  if impl not in ("masked", "gather"):
    raise ValueError(f"impl must be 'masked' or 'gather' (got {impl!r})")
  if (global_kv_BxNxD is None) != (topk_BxTxK is None):
    raise ValueError("global_kv_BxNxD and topk_BxTxK must be given together")
  B, T, H, D = q_BxTxHxD.shape
  S = min(window, T)
  nb = -(-T // S)
  P = min(-(-(window - 1) // S), nb - 1)
  Tp = nb * S
  pad_t = Tp - T

  def pad(x, value=0):
    return jnp.pad(x, [(0, 0), (0, pad_t)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

  q = pad(q_BxTxHxD)
  seg = pad(segment_ids_BxT)
  sink = sink_H.astype(_F32)

  # --- window: block-local scores [B, nb, S, H, L], L = (P+1)·S ------------------------------
  L = (P + 1) * S
  q_blk = q.reshape(B, nb, S, H, D)
  k_blk = _blocks(pad(swa_kv_BxTxD), S, P)                          # [B, nb, L, D]
  seg_k = _blocks(seg, S, P)                                        # [B, nb, L]
  a = jnp.arange(S)[:, None]
  c = jnp.arange(L)[None, :]
  delta = a + P * S - c                                             # t − j inside a block
  in_window = (delta >= 0) & (delta < window)                       # [S, L]
  seg_q = seg.reshape(B, nb, S)
  vis = (in_window[None, None] & (seg_q[..., :, None] == seg_k[..., None, :])
         & (seg_q[..., :, None] > 0))                               # [B, nb, S, L]
  s_swa = jnp.einsum("bnshd,bnld->bnshl", q_blk, k_blk, preferred_element_type=_F32) * scale
  s_swa = jnp.where(vis[:, :, :, None, :], s_swa, _MASKED)
  m = jnp.maximum(jnp.max(s_swa, axis=-1).reshape(B, Tp, H), sink)  # [B, Tp, H]

  # --- global: scores over the selected entries ----------------------------------------------
  if global_kv_BxNxD is not None:
    N = global_kv_BxNxD.shape[1]
    topk = pad(topk_BxTxK, -1)
    valid = topk >= 0                                               # [B, Tp, K]
    if impl == "masked":
      sel = selected_mask(topk, N)                                  # [B, Tp, N]
      s_glob = jnp.einsum("bthd,bnd->bthn", q, global_kv_BxNxD, preferred_element_type=_F32) * scale
      s_glob = jnp.where(sel[:, :, None, :], s_glob, _MASKED)
    else:
      ents = jax.vmap(lambda kv_b, i_b: kv_b[i_b])(global_kv_BxNxD, jnp.maximum(topk, 0))
      s_glob = jnp.einsum("bthd,btkd->bthk", q, ents, preferred_element_type=_F32) * scale
      s_glob = jnp.where(valid[:, :, None, :], s_glob, _MASKED)
    m = jnp.maximum(m, jnp.max(s_glob, axis=-1))
  m = jax.lax.stop_gradient(m)  # the softmax is invariant to the shift; keep its gradient simple

  # --- one normaliser: window + global + sink -------------------------------------------------
  # The exponentials are rounded once to the values' dtype and both the numerator and the
  # denominator sum those rounded values (fp32 accumulation): the normalisation stays consistent,
  # and in bf16 the [.., H, N] tensors kept for the backward take half the memory.
  m_blk = m.reshape(B, nb, S, H)
  e_swa = jnp.exp(s_swa - m_blk[..., None]).astype(k_blk.dtype)    # [B, nb, S, H, L]
  denom = jnp.sum(e_swa, axis=-1, dtype=_F32).reshape(B, Tp, H) + jnp.exp(sink - m)
  acc = jnp.einsum("bnshl,bnld->bnshd", e_swa, k_blk, preferred_element_type=_F32)
  acc = acc.reshape(B, Tp, H, D)
  global_probs = None
  if global_kv_BxNxD is not None:
    v = global_kv_BxNxD if impl == "masked" else ents
    e_glob = jnp.exp(s_glob - m[..., None]).astype(v.dtype)         # [B, Tp, H, N or K]
    denom = denom + jnp.sum(e_glob, axis=-1, dtype=_F32)
    if impl == "masked":
      acc = acc + jnp.einsum("bthn,bnd->bthd", e_glob, v, preferred_element_type=_F32)
      # global_probs reads the K selected columns only, not all N.
      e_glob = jnp.take_along_axis(e_glob, jnp.maximum(topk, 0)[:, :, None, :], axis=-1)
    else:
      acc = acc + jnp.einsum("bthk,btkd->bthd", e_glob, v, preferred_element_type=_F32)
    p_glob = jnp.sum(e_glob.astype(_F32) / denom[..., None], axis=2)  # [B, Tp, K]
    global_probs = jnp.where(valid, p_glob, 0.0)[:, :T]
  o = (acc / denom[..., None]).astype(q_BxTxHxD.dtype)[:, :T]
  return o, global_probs


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
  """D^{-1/2}, with no YaRN mscale (MODEL.md §4.3)."""
  return 1.0 / math.sqrt(head_dim)
