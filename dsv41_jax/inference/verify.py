"""One backbone pass over Q new tokens at positions t … t+Q−1, and the rollback of the tokens a
speculative round rejects (docs/design.md §16.3).

  verify_span(model, cache, tokens_BxQ, t, engram_ids, moe_bias)
      → logits [B, Q, V], final hidden states [B, Q, D], the caches with all Q tokens added, trail
  rollback(old, new, trail, t, n_keep)
      → the caches as if only tokens t … t+n_keep−1 had been decoded (`decode.decode_step` n_keep
        times)

The span is `decode.decode_span`, the decode step's own per-layer pass (a step is the span of one
token; the module docstring there says what each row reads and when entries are written), with the
logits of every row.

Rollback restores exactly what the rejected rows wrote: ring slots holding positions ≥ t + n_keep
(each slot is written at most once since Q ≤ W), entries whose group completes at a rejected
position, and each compressor's pending group, rebuilt from the last kept row of each slot
(`trail` holds the span's compressor inputs, since a rejected row may have overwritten a kept
one's slot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.inference.cache import DecodeCache, GlobalCache, SWACache
from dsv41_jax.inference.decode import decode_span, head_logits
from dsv41_jax.layer_plan import build_layer_plan


def verify_span(model, cache: DecodeCache, tokens_BxQ: jax.Array, t, engram_ids: dict,
                moe_bias_Lx2xE: jax.Array):
  """(logits [B, Q, V], hidden [B, Q, D], caches with the Q tokens added, trail) for tokens at
  positions t … t+Q−1, Q ≤ W (`decode.decode_span`). `engram_ids`: Engram layer → [B, Q, H] rows.
  `trail`: KV-source layer → its compressor inputs [B, Q, D], for `rollback`."""
  h, new, trail = decode_span(model, cache, tokens_BxQ, t, engram_ids, moe_bias_Lx2xE)
  return head_logits(model, h), h, new, trail


def rollback(cfg: ModelConfig, old: DecodeCache, new: DecodeCache, trail: dict, t, n_keep
             ) -> DecodeCache:
  """`new` (a verified span of Q tokens from position t over `old`) with the writes of rows
  n_keep … Q−1 undone (module docstring); t and n_keep may be traced."""
  plan = {s.index: s for s in build_layer_plan(cfg)}
  end = jnp.asarray(t, jnp.int32) + jnp.asarray(n_keep, jnp.int32)    # first rejected position
  swa = []
  for o, n in zip(old.swa, new.swa):
    bad = (n.pos_W >= end)                                              # [W]: rejected rows
    swa.append(SWACache(jnp.where(bad[None, :, None], o.codes_BxWxD, n.codes_BxWxD),
                        jnp.where(bad[None, :, None], o.scales_BxWxR, n.scales_BxWxR),
                        jnp.where(bad, o.pos_W, n.pos_W)))
  glob = {}
  for i, n in new.glob.items():
    o, m = old.glob[i], plan[i].compress_ratio
    N = n.main_BxNxD2.shape[1]
    done_at = (jnp.arange(N, dtype=jnp.int32) + 1) * m - 1              # completing position
    bad = (done_at >= end)[None, :, None]
    arrays = [jnp.where(bad, a_o, a_n) for a_o, a_n in zip(o[:4], n[:4])]
    src = trail[i]                                                      # [B, Q, D]
    Q = src.shape[1]
    p = jnp.asarray(t, jnp.int32) + jnp.arange(Q, dtype=jnp.int32)
    pending = o.pending_BxmxD
    for j in range(Q):   # in order: the last kept row of each slot wins
      row = jnp.where(p[j] < end, src[:, j].astype(pending.dtype),
                      jax.lax.dynamic_index_in_dim(pending, p[j] % m, axis=1, keepdims=False))
      pending = jax.lax.dynamic_update_index_in_dim(pending, row, p[j] % m, axis=1)
    glob[i] = GlobalCache(*arrays, pending)
  return DecodeCache(tuple(swa), glob)
