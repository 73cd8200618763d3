"""The drafter's losses against the frozen backbone (docs/design.md §16.2).

For anchor t and draft position i = 1 … K, the target is the backbone's own distribution of token
t+i, P_{t+i−1} = softmax(backbone logits at row t+i−1), and the draft's logits are the base logits
plus the Markov term of the previous token, teacher-forced: x_{t+i−1} (x_t for i = 1).

  draft loss       −Σ_v P_{t+i−1}(v) log q_{t,i}(v)       (cross-entropy against the backbone)
  confidence loss  BCE(c_{t,i}, a_{t,i}),  a = [argmax q_{t,i} = argmax P_{t+i−1}]   (realised
                   greedy acceptance of the draft against the backbone's own prediction)

both averaged over the valid (anchor, i): row t+i−1 in the sequence and in t's document, with a
target (`loss_mask`). The figures returned besides: per-position acceptance and the mean
accepted length Σ_i Π_{j≤i} a_{t,j} of a greedy verification of all K drafts (teacher-forced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shift_rows(x_BxTx, K: int, fill=0):
  """[B, T, K, ...]: row t, slot i (0-based) holds x[t + i] (fill past the end)."""
  T = x_BxTx.shape[1]
  pad = jnp.concatenate([x_BxTx, jnp.full((x_BxTx.shape[0], K, *x_BxTx.shape[2:]), fill,
                                          x_BxTx.dtype)], axis=1)
  return jnp.stack([pad[:, i:i + T] for i in range(K)], axis=2)


def draft_targets(tokens_BxT, segment_ids_BxT, loss_mask_BxT, K: int):
  """(previous tokens [B, T, K], valid [B, T, K]) of every (anchor t, position i)."""
  prev = shift_rows(tokens_BxT, K)                                   # x_{t+i−1}
  seg = shift_rows(segment_ids_BxT, K, fill=-1)
  valid = (seg == segment_ids_BxT[..., None]) & (segment_ids_BxT[..., None] > 0)
  return prev, valid & shift_rows(loss_mask_BxT.astype(bool), K, fill=False)


def drafter_losses(draft_logits_BxTxKxV, conf_logit_BxTxK, backbone_logits_BxTxV, valid_BxTxK,
                   confidence_weight: float = 1.0):
  """(total loss, figures) of the module docstring."""
  K = draft_logits_BxTxKxV.shape[2]
  P_logits = jax.lax.stop_gradient(shift_rows(backbone_logits_BxTxV.astype(jnp.float32), K))
  P = jax.nn.softmax(P_logits, axis=-1)
  logq = jax.nn.log_softmax(draft_logits_BxTxKxV.astype(jnp.float32), axis=-1)
  w = valid_BxTxK.astype(jnp.float32)
  n = jnp.maximum(w.sum(), 1.0)
  ce = -jnp.sum(P * logq, axis=-1)
  draft_loss = jnp.sum(ce * w) / n
  accepted = (jnp.argmax(logq, -1) == jnp.argmax(P_logits, -1)).astype(jnp.float32)
  z = conf_logit_BxTxK.astype(jnp.float32)
  bce = jnp.maximum(z, 0) - z * accepted + jnp.log1p(jnp.exp(-jnp.abs(z)))
  conf_loss = jnp.sum(bce * w) / n
  survived = jnp.cumprod(accepted * w, axis=-1)
  anchors = jnp.maximum(w[..., 0].sum(), 1.0)
  figures = dict(draft_loss=draft_loss, confidence_loss=conf_loss,
                 accept_rate_K=jnp.sum(accepted * w, axis=(0, 1)) / jnp.maximum(w.sum((0, 1)), 1.0),
                 accepted_length=jnp.sum(survived) / anchors)
  return draft_loss + confidence_weight * conf_loss, figures
