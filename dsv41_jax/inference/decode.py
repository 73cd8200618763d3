"""Prefill and decode (spans of Q tokens, a step is Q = 1) over the stored caches (docs/design.md
§4–§8, §5.7, §6, §10, §16.3).

One sequence per batch row, a single document (positions = row index, segment 1); every row of a
batch sits at the same position t.

Decode over a span of Q ≤ W new tokens at positions t … t+Q−1 (`decode_span`; a decode step
`decode_step` is Q = 1, `verify.verify_span` Q > 1), layer by layer, every layer once over the Q
rows, with the layer's weights from `Transformer.layer(i)`; row j is at position p = t + j:

  Engram layers   X += gate · value of the token's n-gram rows          (`Engram`, host hash ids)
  attention site  a_pre, a_post, a_comb = attn_hc(X);  x = attn_norm(collapse(X, pre_mix))
    Full          the compressor input x (or H_{L/2}, kv_input "encoder_final") joins the pending
                  group row by row; when p completes it, (p+1) mod m = 0, the group is pooled
                  (`compress`), normalised, rotated at g·m and written as entry g = p // m (FP4 +
                  E4M3, and the indexer key MXFP4); all Q rows are written before the indexer
                  reads, and visibility is by position, so a later row sees an entry completed
                  inside the span and an earlier one does not
    Full/Reindex  the indexer's queries (`Indexer.queries`) scored over the entries visible at p,
                  g < ⌊(p+1)/m⌋, with the candidate pool (per row) at its source and mask at its
                  consumers, and top-k: the op `indexer_topk` (`Indexer.select`), as in training;
                  Reuse layers reuse the latest top-k of their index source
    attention     one softmax with sink over the row's own key and the span's keys before it (the
                  local causal window), the valid ring slots (positions p − W < s < t) and the
                  selected entries (the op `sparse_attention`, form "gather": the window and the
                  entries are both passed as gathered keys), then the output path; the span's
                  keys then go into ring slots p mod W (each written once, since Q ≤ W)
  MoE site        X, x, f_pre, f_post, f_comb = the single-pass site (`block.next_site`, the op
                  `hc_site`); routed (dropless) + shared experts
  head            final_norm(collapse(X, pre_mix)) @ head → logits [B, Q, V]
  (the plain residual, `cfg.residual == "plain"`: no sites, X ← X + F; `block.site_output`)

The span's keys are the values the caches hold (`cache.py`: the stored formats, or the forward
pass's own values), so with `stored_formats=False` it equals the forward pass up to float rounding,
and with the stored formats it is the forward pass with the QAT quantizers on (up to code flips,
see `cache.py`); for a model trained with them off the formats are an approximation.

Prefill (`prefill`) runs the prompt as one sequence per layer (`block.layer_forward`), keeping what
the caches need from each layer's attention input: the last W SWA keys and, at Full layers, the
entries of the complete groups and the pending partial group. Two paths:

  "full"  every layer over all N prompt tokens. Decode afterwards is exact (the exact path).
  "ced"   (docs/design.md §6) the encoder over all N tokens; the decoder's global KV from the final
          encoder state H_{L/2} (`block.prefill_kv` math), and the decoder's SWA rings by bounded
          replay (§5.7): the decoder runs as one sequence over the last W prompt tokens only,
          starting at s = max(0, N − W) with empty rings. A replayed token i sees decoder window
          keys [max(s, i − W + 1), i] instead of [i − W + 1, i]; its decoder input H_{L/2} and the
          decoder's global KV are exact (the encoder ran over everything). For N ≤ W (s = 0) the
          two paths are the same function. For N > W the decoder's SWA keys of the replayed tokens
          differ, and each decoder layer carries the difference W − 1 positions further, so the
          logits may differ before position N − 1 + (L_dec − 1)(W − 1) and are exact from there on
          (tested; sizes in benchmarks/RESULTS.md). The decoder costs W tokens instead of N.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.block import (Context, StreamState, encoder_final_input, layer_forward, next_site,
                             site_coefficients, site_input, site_output)
from dsv41_jax.config import ModelConfig
from dsv41_jax.inference import cache as cache_lib
from dsv41_jax.inference.cache import DecodeCache, GlobalCache, SWACache
from dsv41_jax.layer_plan import LayerSpec
from dsv41_jax.layers import moe_dispatch, rope
from dsv41_jax.layers.compressor import compress
from dsv41_jax.layers.indexer import empty_candidate
from dsv41_jax.layers.moe import route
from dsv41_jax.layers.types import CompressedKV
from pallas_kernels import dispatch
from pallas_kernels.ops.sparse_attention import default_scale


# --- pieces shared by prefill and decode --------------------------------------------------------

def _swa_key(core, x_BxTxD: jax.Array, positions_BxT: jax.Array) -> jax.Array:
  """The layer's SWA key before quantization: RoPE(RMSNorm_w(x @ wkv)) (docs/design.md §4.2)."""
  attn = core.attn
  dt = x_BxTxD.dtype
  kv = attn.kv_norm(jnp.einsum("btd,dc->btc", x_BxTxD, attn.wkv[...].astype(dt)))
  return rope.apply_rope(kv, positions_BxT, attn.inv_freq)


def _entries(core, pub, src_BxGxmxD: jax.Array, g0) -> tuple[jax.Array, jax.Array]:
  """(main KV, indexer K) before quantization of the G complete groups src [B, G, m, D] whose
  first is entry g0 (docs/design.md §5.2–5.3; the same ops as `Compressor` and `Indexer.keys`)."""
  comp, idx = pub.compressor, pub.indexer
  B, G, m, D = src_BxGxmxD.shape
  dt = src_BxGxmxD.dtype
  wgate = None if comp.wgate is None else comp.wgate[...]
  c = compress(src_BxGxmxD.reshape(B, G * m, D), comp.wkv[...], wgate, m)
  latent = comp.norm(c)
  pos = jnp.broadcast_to((g0 + jnp.arange(G, dtype=jnp.int32)) * m, (B, G))
  main = rope.apply_rope(latent, pos, core.attn.inv_freq)
  latent = latent.astype(dt)
  k = idx.k_norm(jnp.einsum("bnc,ci->bni", latent, idx.wk[...].astype(dt)))
  return main, rope.apply_rope(k, pos, core.attn.inv_freq)


def _gather_main(g: GlobalCache, topk_BxQxK: jax.Array) -> jax.Array:
  """The selected main-KV entries of every row, decoded: [B, Q, K, D] (rows of empty slots are
  entry 0)."""
  B, Q, K = topk_BxQxK.shape
  i = jnp.maximum(topk_BxQxK, 0).reshape(B, Q * K)
  take = lambda a: jnp.take_along_axis(a, i[:, :, None], axis=1)
  return cache_lib.read_main(take(g.main_BxNxD2), take(g.main_scale_BxNxS)).reshape(B, Q, K, -1)


def _moe(cfg: ModelConfig, moe, x_BxTxD: jax.Array, bias_E: jax.Array) -> jax.Array:
  """Routed experts (dropless) + shared expert of one MoE layer (docs/design.md §8; `MoE.__call__`
  without the balance statistics, for text tokens). Batchable: under `jax.vmap` (independent
  requests, `speculative.py`) the mapped axis joins the batch rows, which is exact since routing
  and experts act per token (XLA's ragged_dot has no batching rule of its own)."""
  graphdef, state = nnx.split(moe)
  leaves, treedef = jax.tree.flatten(state)

  @jax.custom_batching.custom_vmap
  def f(x, *leaves):
    return _moe_rows(cfg, nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), x, bias_E)

  @f.def_vmap
  def rule(axis_size, in_batched, x, *leaves):
    if any(in_batched[1:]):
      raise ValueError("the MoE weights must be shared by the mapped requests")
    y = f(x.reshape(-1, *x.shape[2:]), *leaves)
    return y.reshape(x.shape[:2] + y.shape[1:]), True

  return f(x_BxTxD, *leaves)


def _moe_rows(cfg: ModelConfig, moe, x_BxTxD: jax.Array, bias_E: jax.Array) -> jax.Array:
  """`_moe` of unmapped rows."""
  logits = jnp.einsum("btd,de->bte", x_BxTxD.astype(jnp.float32),
                      moe.router[...].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  weights, experts, _ = route(logits, bias_E, moe.k, moe.route_scale, moe.gate_temp)
  x = x_BxTxD.astype(moe.dtype)
  valid = jnp.ones(x.shape[:2], bool)
  y, _ = moe_dispatch.routed_experts(x, weights, experts, valid, moe.experts.w1[...],
                                     moe.experts.w3[...], moe.experts.w2[...], mode="dropless",
                                     swiglu_limit=moe.limit, policy=moe.grouped_matmul_policy)
  if moe.shared is not None:
    y = y + moe.shared(x)
  return y.astype(x_BxTxD.dtype)


def final_hidden(model, X_BxTxNxD: jax.Array, pre_BxTxN: jax.Array) -> jax.Array:
  """The head's input, final_norm(collapse(X, pre_mix)) [B, T, D] (what the DSpark drafter reads)."""
  return site_input(model.cfg, model.final_norm, X_BxTxNxD, pre_BxTxN)


def head_logits(model, h_BxTxD: jax.Array) -> jax.Array:
  return jnp.einsum("btd,dv->btv", h_BxTxD, model.head[...].astype(model.cfg.dtype),
                    preferred_element_type=jnp.float32)


# --- decode: a span of Q tokens, a step is Q = 1 -----------------------------------------------

def _compressor_step(cfg, core, pub, g: GlobalCache, src_Bx1xD, t, m: int) -> GlobalCache:
  """Add token t's compressor input to the pending group; write entry t // m when it completes."""
  pending = jax.lax.dynamic_update_index_in_dim(g.pending_BxmxD, src_Bx1xD.astype(
      g.pending_BxmxD.dtype), t % m, axis=1)
  gi = t // m
  main, key = _entries(core, pub, pending[:, None], gi)                 # [B, 1, ·]
  new = cache_lib.entry_arrays(cfg, g, main, key)
  done = (t + 1) % m == 0
  rows = []
  for old, n in zip(g[:4], new):
    cur = jax.lax.dynamic_index_in_dim(old, gi, axis=1)
    rows.append(jax.lax.dynamic_update_index_in_dim(old, jnp.where(done, n.astype(old.dtype), cur),
                                                    gi, axis=1))
  return GlobalCache(*rows, pending)


def _attention_span(cfg, core, x_BxQxD, c_q, pos_BxQ, t, ring: SWACache,
                    sel_BxQxKxD: jax.Array | None, sel_valid_BxQxK: jax.Array | None
                    ) -> tuple[jax.Array, SWACache]:
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
  for j in range(Q):   # distinct slots, since Q ≤ W
    slot = (t + j) % W
    ring = SWACache(
        jax.lax.dynamic_update_index_in_dim(ring.codes_BxWxD, codes[:, j], slot, axis=1),
        jax.lax.dynamic_update_index_in_dim(ring.scales_BxWxR, scales[:, j], slot, axis=1),
        ring.pos_W.at[slot].set(t + j))
  return core.attn.output(o, pos_BxQ), ring


def _index_span(cfg, spec: LayerSpec, pub, x, c_q, pos_BxQ, t, g: GlobalCache, m: int,
                pool) -> tuple[jax.Array, Any]:
  """(topk [B, Q, K], candidate pool or the one given) of a Full / Reindex layer for the span's
  rows."""
  idx = pub.indexer
  q, w = idx.queries(x, c_q, pos_BxQ)
  k = cache_lib.read_index(g).astype(q.dtype)
  B, N = k.shape[:2]
  n = jnp.arange(N, dtype=jnp.int32)
  # Row r of the span is at position t + r: entry_last shifted by −t.
  meta = CompressedKV(None, k, jnp.ones((B, N), jnp.int32),
                      jnp.broadcast_to((n + 1) * m - 1 - t, (B, N)), jnp.broadcast_to(n * m, (B, N)))
  topk, _, out = idx.select(q, w, meta, jnp.ones(pos_BxQ.shape, jnp.int32), pool)
  if spec.candidate_role == "source":
    pool = out
  return topk, pool


def decode_span(model, cache: DecodeCache, tokens_BxQ: jax.Array, t, engram_ids: dict,
                moe_bias_Lx2xE: jax.Array) -> tuple[jax.Array, DecodeCache, dict]:
  """(final hidden states [B, Q, D], caches with the Q tokens added, trail) for tokens at positions
  t … t+Q−1, Q ≤ W (module docstring). `engram_ids`: Engram layer → [B, Q, H] rows (`inputs.
  engram_ids` of each token's n-gram). `trail`: KV-source layer → its compressor inputs [B, Q, D]
  (what `verify.rollback` rebuilds the pending groups from)."""
  cfg: ModelConfig = model.cfg
  plan = model.plan
  dt = jnp.dtype(cfg.dtype)
  B, Q = tokens_BxQ.shape
  if Q > cfg.sliding_window:
    raise ValueError(f"a span of {Q} tokens exceeds the sliding window ({cfg.sliding_window})")
  t = jnp.asarray(t, jnp.int32)
  pos = jnp.broadcast_to(t + jnp.arange(Q, dtype=jnp.int32), (B, Q))
  s = model.initial_state(model.embed_tokens(tokens_BxQ))
  X, pre = s.X_BxTxNxD, s.pre_mix_BxTxN
  swa, glob = list(cache.swa), dict(cache.glob)
  topk, trail = {}, {}   # index-source layer → its top-k; KV-source layer → its compressor inputs
  pool = enc = None
  for i in range(len(plan)):
    spec = plan[i]
    if i == plan.num_encoder_layers:
      enc = StreamState(X, pre)
    core, pub, engram = model.layer(i)
    if engram is not None:
      X, _ = engram(X, engram_ids[i], jnp.ones((B, Q), bool))
    a_pre, a_post, a_comb = site_coefficients(cfg, "attn_hc", core, X, pre)
    x = site_input(cfg, core.attn_norm, X, pre)
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
      sel, valid = _gather_main(g, sel_idx), sel_idx >= 0
    y, swa[i] = _attention_span(cfg, core, x, c_q, pos, t, swa[i], sel, valid)
    X, x, f_pre, f_post, f_comb = next_site(cfg, "ffn_hc", core.ffn_norm, core, X, y, a_post,
                                            a_comb, a_pre)
    X = site_output(X, f_post, f_comb, _moe(cfg, core.moe, x, moe_bias_Lx2xE[i, 0]))
    pre = f_pre
  return final_hidden(model, X, pre), DecodeCache(tuple(swa), glob), trail


def decode_step(model, cache: DecodeCache, token_B: jax.Array, t, engram_ids: dict,
                moe_bias_Lx2xE: jax.Array) -> tuple[jax.Array, DecodeCache]:
  """Logits [B, V] of the token at position t (`decode_span` of one token), and the caches with t
  added. `engram_ids`: Engram layer → [B, 1, H] rows of the token."""
  h, cache, _ = decode_span(model, cache, token_B[:, None], t, engram_ids, moe_bias_Lx2xE)
  return head_logits(model, h)[:, 0], cache


# --- prefill -----------------------------------------------------------------------------------

def _fill_swa(cfg, ring: SWACache, key_BxTxD: jax.Array, first: int = 0) -> SWACache:
  """Store the last min(T, W) of T keys at positions first … first + T − 1 in their slots
  (position p → slot p mod W)."""
  T = key_BxTxD.shape[1]
  W = ring.pos_W.shape[0]
  start = max(0, T - W)
  p = first + jnp.arange(start, T, dtype=jnp.int32)
  codes, scales = cache_lib.key_arrays(cfg, ring, key_BxTxD[:, start:])
  return SWACache(ring.codes_BxWxD.at[:, p % W].set(codes), ring.scales_BxWxR.at[:, p % W].set(scales),
                  ring.pos_W.at[p % W].set(p))


def _fill_global(cfg, core, pub, g: GlobalCache, src_BxTxD: jax.Array, m: int) -> GlobalCache:
  """Entries of the complete groups of a T-token prompt, and its partial group as pending."""
  B, T, D = src_BxTxD.shape
  G = T // m
  arrays = list(g[:4])
  if G:
    main, key = _entries(core, pub, src_BxTxD[:, :G * m].reshape(B, G, m, D), 0)
    new = cache_lib.entry_arrays(cfg, g, main, key)
    arrays = [a.at[:, :G].set(n.astype(a.dtype)) for a, n in zip(arrays, new)]
  pending = g.pending_BxmxD
  if T > G * m:
    pending = pending.at[:, :T - G * m].set(src_BxTxD[:, G * m:].astype(pending.dtype))
  return GlobalCache(*arrays, pending)


def prefill(model, cache: DecodeCache, tokens_BxT: jax.Array, engram_ids: dict,
            moe_bias_Lx2xE: jax.Array, *, depth: str = "ced") -> dict[str, Any]:
  """Run a T-token prompt into empty caches (module docstring for the two paths).

  Returns {"cache", "last_logits" [B, V] (the logits of the last prompt token), "hidden" (the final
  hidden states `final_hidden` of the rows the decoder ran: all T for "full", the replayed
  T − s for "ced")}; depth "full" adds "logits" [B, T, V].
  """
  if depth not in ("full", "ced"):
    raise ValueError(f"prefill depth must be 'full' or 'ced' (got {depth!r})")
  cfg: ModelConfig = model.cfg
  plan = model.plan
  dt = jnp.dtype(cfg.dtype)
  B, T = tokens_BxT.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  ctx = Context(positions, jnp.ones((B, T), jnp.int32), jnp.zeros((B, T), bool), dict(engram_ids))
  state = model.initial_state(model.embed_tokens(tokens_BxT))
  swa, glob = list(cache.swa), dict(cache.glob)
  n_enc = plan.num_encoder_layers
  enc = None
  for r, run in enumerate(plan.runs):
    if run.first_layer == n_enc:
      enc = state = StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN)  # the decoder's own KV
      if depth == "ced":
        break
      ctx = Context(ctx.positions_BxT, ctx.segment_ids_BxT, ctx.image_mask_BxT, ctx.engram_ids,
                    encoder_final=enc if cfg.kv_source_input == "encoder_final" else None)
    for k, spec in enumerate(run.layers):
      core, pub, engram = model.layer(spec.index)
      if engram is not None:
        X, _ = engram(state.X_BxTxNxD, engram_ids[spec.index], jnp.ones((B, T), bool))
        state = state._replace(X_BxTxNxD=X)
      if k == 0:
        state = model._prepare_carry(run, state, ctx)
      x = site_input(cfg, core.attn_norm, state.X_BxTxNxD, state.pre_mix_BxTxN)
      swa[spec.index] = _fill_swa(cfg, swa[spec.index], _swa_key(core, x, positions))
      if spec.owns_compressor:
        src = x if spec.kv_input == "own" else encoder_final_input(cfg, core, enc)
        glob[spec.index] = _fill_global(cfg, core, pub, glob[spec.index], src,
                                        spec.compress_ratio)
      state, _ = layer_forward(cfg, [spec], core, [pub], state, ctx, moe_bias_Lx2xE[spec.index])
  if depth == "full":
    hidden = final_hidden(model, state.X_BxTxNxD, state.pre_mix_BxTxN)
    logits = head_logits(model, hidden)
    return {"cache": DecodeCache(tuple(swa), glob), "logits": logits, "last_logits": logits[:, -1],
            "hidden": hidden}
  for spec in plan.layers[n_enc:]:   # the decoder's KV sources, projected from H_{L/2} (§6)
    if spec.owns_compressor:
      if not spec.prefills_from_encoder:
        raise ValueError(f"decoder KV source layer {spec.index} projects from its own input, not "
                         "from the final encoder state: CED prefill cannot build its cache")
      core, pub, _ = model.layer(spec.index)
      glob[spec.index] = _fill_global(cfg, core, pub, glob[spec.index],
                                      encoder_final_input(cfg, core, enc), spec.compress_ratio)
  hidden = _replay(model, swa, glob, enc, engram_ids, moe_bias_Lx2xE)
  return {"cache": DecodeCache(tuple(swa), glob),
          "last_logits": head_logits(model, hidden[:, -1:])[:, 0], "hidden": hidden}


def _shared_kv(cfg, g: GlobalCache, m: int, T: int, s: int) -> CompressedKV:
  """The stored entries of a T-token prompt as the `CompressedKV` a sequence of rows s … T − 1
  reads: entry_last shifted by −s, so that `entry_visible` at row r means at position s + r."""
  B, N = g.main_BxNxD2.shape[:2]
  dt = jnp.dtype(cfg.dtype)
  n = jnp.arange(N, dtype=jnp.int32)
  whole = jnp.broadcast_to(jnp.where((n + 1) * m <= T, 1, -1), (B, N))
  return CompressedKV(cache_lib.read_main(g.main_BxNxD2, g.main_scale_BxNxS).astype(dt),
                      cache_lib.read_index(g).astype(dt), whole.astype(jnp.int32),
                      jnp.broadcast_to((n + 1) * m - 1 - s, (B, N)), jnp.broadcast_to(n * m, (B, N)))


def _replay(model, swa: list, glob: dict, enc: StreamState, engram_ids: dict,
            moe_bias_Lx2xE: jax.Array) -> jax.Array:
  """Bounded replay (docs/design.md §5.7): the decoder layers over prompt rows s … T − 1 only, as one
  sequence (`block.layer_forward`), from the final encoder state of those rows, reading the
  decoder's stored global entries (a Full layer runs as its indexer only: its entries are in the
  cache). Fills the decoder's SWA rings in `swa`; returns the replayed rows' final hidden states
  [B, T − s, D]."""
  cfg: ModelConfig = model.cfg
  plan = model.plan
  dt = jnp.dtype(cfg.dtype)
  B, T = enc.pre_mix_BxTxN.shape[:2]
  s = replay_start(cfg, T)
  R = T - s
  positions = jnp.broadcast_to(jnp.arange(s, T, dtype=jnp.int32), (B, R))
  ctx = Context(positions, jnp.ones((B, R), jnp.int32), jnp.zeros((B, R), bool),
                {l: ids[:, s:] for l, ids in engram_ids.items()})
  state = StreamState(enc.X_BxTxNxD[:, s:], enc.pre_mix_BxTxN[:, s:])
  for run in plan.runs:
    if run.is_encoder:
      continue
    for k, spec in enumerate(run.layers):
      core, pub, engram = model.layer(spec.index)
      if engram is not None:
        X, _ = engram(state.X_BxTxNxD, ctx.engram_ids[spec.index], jnp.ones((B, R), bool))
        state = state._replace(X_BxTxNxD=X)
      if spec.reads_global_kv and (k == 0 or spec.owns_compressor):
        kv = _shared_kv(cfg, glob[spec.kv_source], spec.compress_ratio, T, s)
        N = kv.entry_last_BxN.shape[1]
        cand = (empty_candidate(cfg, B, R, N) if any(l.candidate_role == "source" for l in run.layers)
                else state.candidate)
        state = StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN, kv,
                            jnp.full((B, R, min(cfg.index_topk, N)), -1, jnp.int32), cand)
      if spec.owns_compressor:  # its entries are stored: index them like a Reindex layer
        spec = dataclasses.replace(spec, mode="reindex", kv_input=None)
      x = site_input(cfg, core.attn_norm, state.X_BxTxNxD, state.pre_mix_BxTxN)
      swa[spec.index] = _fill_swa(cfg, swa[spec.index], _swa_key(core, x, positions), s)
      state, _ = layer_forward(cfg, [spec], core, [pub], state, ctx, moe_bias_Lx2xE[spec.index])
  return final_hidden(model, state.X_BxTxNxD, state.pre_mix_BxTxN)


def replay_start(cfg: ModelConfig, prompt_len: int) -> int:
  """s = max(0, N − W): the first prompt token the CED decoder replays (docs/design.md §5.7)."""
  return max(0, prompt_len - cfg.sliding_window)

