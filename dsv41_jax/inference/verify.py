"""One backbone pass over Q new tokens at positions t … t+Q−1, and the rollback of the tokens a
speculative round rejects (docs/design.md §16.3).

  verify_span(model, cache, tokens_BxQ, t, engram_ids, moe_bias)
      → logits [B, Q, V], final hidden states [B, Q, D], the caches with all Q tokens added, trail
  rollback(old, new, trail, t, n_keep)
      → the caches as if only tokens t … t+n_keep−1 had been decoded (`decode.decode_step` n_keep
        times)

The span runs every layer once over its Q rows, the same layer functions as `decode.decode_step`
(which is this with Q = 1): query p = t + j reads its own key and the span keys before it (the
local causal window; Q ≤ sliding_window), the ring's keys of positions p − W < s < t, and the
entries its indexer selects among those visible at p, g < ⌊(p+1)/m⌋. Entries completed inside the
span are written before the indexer reads them (`decode._compressor_step` per row, so an entry is
the bit-exact value a decode step writes), so a later row sees them and an earlier one does not
(visibility is by position). The candidate pool is per row, as in the forward pass.

Rollback restores exactly what the rejected rows wrote: ring slots holding positions ≥ t + n_keep
(each slot is written at most once since Q ≤ W), entries whose group completes at a rejected
position, and each compressor's pending group, rebuilt from the last kept row of each slot
(`trail` holds the span's compressor inputs, since a rejected row may have overwritten a kept
one's slot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.block import (StreamState, encoder_final_input, next_site, site_coefficients,
                             site_output)
from dsv41_jax.config import ModelConfig
from dsv41_jax.inference import cache as cache_lib
from dsv41_jax.inference.cache import DecodeCache, GlobalCache, SWACache
from dsv41_jax.inference.decode import (_compressor_step, _moe, _swa_key, final_hidden,
                                        head_logits)
from dsv41_jax.layer_plan import LayerSpec, build_layer_plan
from dsv41_jax.layers import mhc
from dsv41_jax.layers.types import CompressedKV
from pallas_kernels import dispatch
from pallas_kernels.ops.sparse_attention import default_scale


def _tokenwise_moe(cfg, moe, x_BxTxD: jax.Array, bias_E: jax.Array) -> jax.Array:
  """`decode._moe`, batchable: under `jax.vmap` (independent requests, `speculative.py`) the
  mapped axis joins the batch rows, which is exact since routing and experts act per token
  (XLA's ragged_dot has no batching rule of its own)."""
  graphdef, state = nnx.split(moe)
  leaves, treedef = jax.tree.flatten(state)

  @jax.custom_batching.custom_vmap
  def f(x, *leaves):
    return _moe(cfg, nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), x, bias_E)

  @f.def_vmap
  def rule(axis_size, in_batched, x, *leaves):
    if any(in_batched[1:]):
      raise ValueError("the MoE weights must be shared by the mapped requests")
    y = f(x.reshape(-1, *x.shape[2:]), *leaves)
    return y.reshape(x.shape[:2] + y.shape[1:]), True

  return f(x_BxTxD, *leaves)


def _index_span(cfg, spec: LayerSpec, pub, x, c_q, pos_BxQ, t, g: GlobalCache, m: int, pool):
  """(topk [B, Q, K], candidate pool) of a Full / Reindex layer for the span's rows (the decode
  step's `_index_step` over Q rows: row r is at position t + r)."""
  idx = pub.indexer
  q, w = idx.queries(x, c_q, pos_BxQ)
  k = cache_lib.read_index(g).astype(q.dtype)
  B, N = k.shape[:2]
  n = jnp.arange(N, dtype=jnp.int32)
  meta = CompressedKV(None, k, jnp.ones((B, N), jnp.int32),
                      jnp.broadcast_to((n + 1) * m - 1 - t, (B, N)), jnp.broadcast_to(n * m, (B, N)))
  topk, _, out = idx.select(q, w, meta, jnp.ones(pos_BxQ.shape, jnp.int32), pool)
  if spec.candidate_role == "source":
    pool = out
  return topk, pool


def _gather_span(g: GlobalCache, topk_BxQxK: jax.Array) -> jax.Array:
  """The selected main-KV entries of every row, decoded: [B, Q, K, D]."""
  B, Q, K = topk_BxQxK.shape
  i = jnp.maximum(topk_BxQxK, 0).reshape(B, Q * K)
  take = lambda a: jnp.take_along_axis(a, i[:, :, None], axis=1)
  sel = cache_lib.read_main(take(g.main_BxNxD2), take(g.main_scale_BxNxS))
  return sel.reshape(B, Q, K, -1)


def _attention_span(cfg, core, x_BxQxD, c_q, pos_BxQ, t, ring: SWACache, sel_BxQxKxD,
                    sel_valid_BxQxK) -> tuple[jax.Array, SWACache]:
  """The span's queries over their causal span keys, the ring's older window and their selected
  entries (one softmax with sink); the ring with the span's keys written."""
  W = cfg.sliding_window
  B, Q = pos_BxQ.shape
  q = core.attn.queries(c_q, pos_BxQ)                                   # [B, Q, H, D]
  codes, scales = cache_lib.key_arrays(cfg, ring, _swa_key(core, x_BxQxD, pos_BxQ))
  own = cache_lib.read_keys(codes, scales).astype(q.dtype)              # [B, Q, D]
  window = cache_lib.read_keys(ring.codes_BxWxD, ring.scales_BxWxR).astype(q.dtype)
  p = pos_BxQ[0][:, None]                                               # [Q, 1]
  ok = (ring.pos_W >= 0) & (ring.pos_W > p - W) & (ring.pos_W < t)      # [Q, W]
  keys = window
  idx = jnp.broadcast_to(jnp.where(ok, jnp.arange(W), -1), (B, Q, W))
  if sel_BxQxKxD is not None:
    K = sel_BxQxKxD.shape[2]
    keys = jnp.concatenate([keys, sel_BxQxKxD.reshape(B, Q * K, -1).astype(q.dtype)], axis=1)
    own_slots = W + jnp.arange(Q)[:, None] * K + jnp.arange(K)          # [Q, K]
    idx = jnp.concatenate([idx, jnp.where(sel_valid_BxQxK, own_slots, -1)], axis=-1)
  o, _ = dispatch.call("sparse_attention", q, own, jnp.ones((B, Q), jnp.int32),
                       core.attn.attn_sink[...], keys, idx.astype(jnp.int32),
                       policy=cfg.ops.sparse_attention, window=W,
                       scale=default_scale(cfg.head_dim), impl="gather")
  slots = (t + jnp.arange(Q)) % W
  ring = SWACache(ring.codes_BxWxD.at[:, slots].set(codes), ring.scales_BxWxR.at[:, slots].set(scales),
                  ring.pos_W.at[slots].set(t + jnp.arange(Q, dtype=jnp.int32)))
  return core.attn.output(o, pos_BxQ), ring


def verify_span(model, cache: DecodeCache, tokens_BxQ: jax.Array, t, engram_ids: dict,
                moe_bias_Lx2xE: jax.Array):
  """(logits [B, Q, V], hidden [B, Q, D], caches with the Q tokens added, trail) for tokens at
  positions t … t+Q−1 (module docstring). `engram_ids`: Engram layer → [B, Q, H] rows.
  `trail`: KV-source layer → its compressor inputs [B, Q, D], for `rollback`."""
  cfg: ModelConfig = model.cfg
  plan = model.plan
  dt = jnp.dtype(cfg.dtype)
  B, Q = tokens_BxQ.shape
  if Q > cfg.sliding_window:
    raise ValueError(f"a verified span of {Q} tokens exceeds the sliding window "
                     f"({cfg.sliding_window})")
  t = jnp.asarray(t, jnp.int32)
  pos = jnp.broadcast_to(t + jnp.arange(Q, dtype=jnp.int32), (B, Q))
  s = model.initial_state(model.embed_tokens(tokens_BxQ))
  X, pre = s.X_BxTxNxD, s.pre_mix_BxTxN
  swa, glob = list(cache.swa), dict(cache.glob)
  topk, trail = {}, {}
  pool = enc = None
  for i in range(len(plan)):
    spec = plan[i]
    if i == plan.num_encoder_layers:
      enc = StreamState(X, pre)
    core, pub, engram = model.layer(i)
    if engram is not None:
      X, _ = engram(X, engram_ids[i], jnp.ones((B, Q), bool))
    a_pre, a_post, a_comb = site_coefficients(cfg, "attn_hc", core, X, pre)
    x = core.attn_norm(mhc.collapse(X, pre)).astype(dt)
    c_q = core.attn.q_latent(x)
    sel = valid = None
    if spec.reads_global_kv:
      m = spec.compress_ratio
      if spec.owns_compressor:
        src = x if spec.kv_input == "own" else encoder_final_input(cfg, core, enc)
        trail[i] = src
        for j in range(Q):
          glob[i] = _compressor_step(cfg, core, pub, glob[i], src[:, j:j + 1], t + j, m)
      g = glob[spec.kv_source]
      if spec.owns_indexer:
        topk[i], pool = _index_span(cfg, spec, pub, x, c_q, pos, t, g, m, pool)
      sel_idx = topk[spec.index_source]
      sel, valid = _gather_span(g, sel_idx), sel_idx >= 0
    y, swa[i] = _attention_span(cfg, core, x, c_q, pos, t, swa[i], sel, valid)
    X, x, f_pre, f_post, f_comb = next_site(cfg, "ffn_hc", core.ffn_norm, core, X, y, a_post,
                                            a_comb, a_pre)
    X = site_output(X, f_post, f_comb, _tokenwise_moe(cfg, core.moe, x, moe_bias_Lx2xE[i, 0]))
    pre = f_pre
  h = final_hidden(model, X, pre)
  return head_logits(model, h), h, DecodeCache(tuple(swa), glob), trail


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
