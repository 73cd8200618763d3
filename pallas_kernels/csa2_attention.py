"""Sparse attention (window ∪ selected entries ∪ sink) with a deterministic backward (docs/design.md §4.3, §14).

The kernel of the op `sparse_attention` (`pallas_kernels.ops.sparse_attention.attend`; tests
compare the two): the forward kernel of `pallas_kernels.sparse_attention`, which also writes
global_probs (or, with `fused_probs=False`, its separate global_probs kernel), and a backward
that has no atomic adds, so two runs are bitwise equal and no float32 atomic sits on a popular
row. For query t, head h (s = (q·k)·scale, K = V):

  p_{t,h,j} = exp(s_{t,h,j} − lse_{t,h})      lse: log of the softmax denominator, sink included
  Δ_{t,h}   = Σ_d dO_{t,h,d} · O_{t,h,d}        ds = p · (dO·k_j − Δ)
  dq_t      = scale · Σ_j ds_{t,·,j} k_j
  dk_j      = Σ_{t,h} scale · ds_{t,h,j} q_{t,h} + p_{t,h,j} dO_{t,h}     (dK + dV of one key)
  dsink_h   = −Σ_t exp(sink_h − lse_{t,h}) · Δ_{t,h}

Kernels of the backward:
  `_dq_kernel`      query-outer, one program per (batch, token, head group), keys as in the
                    forward: the window rows, then the selected entries read by index. Writes dq
                    and, for each selected slot, its contribution C[t, g, slot] = the inner sum of
                    dk_j over the group's heads ([Kp, D] per token; bfloat16 for bfloat16 inputs).
  `_window_dkv_kernel`  key-outer band: one program per block of `block_kw` window keys loops over
                    the queries that can see them (rows j … j + W − 1, all heads folded into the
                    rows of one tile: [bkw, D] · [rows, D]ᵀ), no scatter.
  `_entry_sum_kernel`  d(entries): the slots are sorted by entry (a stable sort of the top-k
                    indices) and one program per entry adds its contributions in that order.
The query rows are processed in pieces that keep C under `max_contrib_elems` (each piece's
d(entries) added in piece order), which also keeps every Triton address below 2^31.
The slot order is a function of top-k alone: `slot_plan` computes it apart, so the layers that
share one selection sort once (the dispatcher's `plan`, docs/design.md §T5).

Backend: Triton via `pl.pallas_call`; `interpret=True` on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels import sparse_attention as _sa
from pallas_kernels.ops.sparse_attention import OUTPUT

_F32 = jnp.float32
_NT = _sa._NT                        # a · bᵀ
_TN = _sa._TN                        # aᵀ · b
_NN = (((1,), (0,)), ((), ()))       # a · b
_dot = _sa._dot

# Triton computes element offsets in 32-bit integers: every array a kernel indexes stays below this.
_MAX_ELEMS = 1 << 31


def _band_rows(T, hp, window, bkw):
  """(query tokens per tile, tiles per key block, padded query tokens) of the window band kernel."""
  bt = max(1, 128 // hp)
  n_q = -(-(bkw + window - 1) // bt)
  return bt, n_q, -(-T // bkw) * bkw + n_q * bt


def unsupported_reason(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT=None, sink_H=None,
                       global_kv_BxNxD=None, topk_BxTxK=None, *, window: int, block_kw: int = 64,
                       **_) -> str | None:
  """Why the kernel cannot take the op's arguments (None if it can): the forward kernel's
  reasons, and the window band kernel's padded [B, T', H_pad, D] query rows past 32-bit offsets."""
  if (reason := _sa.unsupported_reason(q_BxTxHxD, swa_kv_BxTxD, None, None,
                                       window=window)) is not None:
    return reason
  B, T, H, D = q_BxTxHxD.shape
  hp = _sa._Plan(H, D, 0, window, None, None).hp
  elems = B * _band_rows(T, hp, window, block_kw)[2] * hp * D
  if elems >= _MAX_ELEMS:
    return (f"{B} x {T} tokens x {hp} heads x {D}: {elems} padded query elements reach 2^31 "
            "(32-bit offsets in the window band kernel)")
  return None


def _params(interpret, num_warps, num_stages):
  return None if interpret else _sa._triton_params(num_warps, num_stages)


# --- kernels ---------------------------------------------------------------------------------------

def _dq_kernel(q_ref, do_ref, lse_ref, delta_ref, kv_ref, seg_ref, *rest, scale, window, wb, bkw,
               bk, n_chunks, t_off, has_global):
  if has_global:
    gkv_ref, topk_ref, dq_ref, c_ref = rest
  else:
    (dq_ref,) = rest
  t = pl.program_id(1) + t_off
  q = q_ref[...]                                                    # [Hb, D]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  seg_t = seg_ref[pl.ds(t + wb, 1)]

  def grads(k, ok):
    s = _dot(q, k, _NT) * scale
    p = jnp.where(ok[None, :], jnp.exp(s - lse[:, None]), 0.0)     # [Hb, bk]
    ds = p * (_dot(do, k, _NT) - delta[:, None])
    return ds, p

  def window_chunk(c, dq):
    start, ok = _sa._window_rows(t, c, wb, bkw, window, seg_ref, seg_t)
    k = kv_ref[pl.ds(start, bkw), :]
    ds, _ = grads(k, ok)
    return dq + _dot(ds.astype(k.dtype), k, _NN)

  dq = jax.lax.fori_loop(0, wb // bkw, window_chunk, jnp.zeros(q.shape, _F32))
  if has_global:
    def global_chunk(c, dq):
      idx = topk_ref[pl.ds(c * bk, bk)]
      k = gkv_ref[jnp.maximum(idx, 0), :]
      ds, p = grads(k, idx >= 0)
      c_ref[pl.ds(c * bk, bk), :] = (_dot(ds.astype(q.dtype), q, _TN) * scale
                                     + _dot(p.astype(do.dtype), do, _TN)).astype(c_ref.dtype)
      return dq + _dot(ds.astype(k.dtype), k, _NN)
    dq = jax.lax.fori_loop(0, n_chunks, global_chunk, dq)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _window_dkv_kernel(q_ref, do_ref, lse_ref, delta_ref, segq_ref, kv_ref, segk_ref, dkv_ref, *,
                       scale, window, hp, bkw, rows, n_q, t_len):
  j0 = pl.program_id(1) * bkw
  k = kv_ref[pl.ds(j0, bkw), :]                                     # [bkw, D]
  segk = segk_ref[pl.ds(j0, bkw)]
  jrow = j0 + jax.lax.broadcasted_iota(jnp.int32, (bkw,), 0)

  def chunk(c, dk):
    r0 = j0 * hp + c * rows                                         # flat (token, head) row
    qc = q_ref[pl.ds(r0, rows), :]                                  # [rows, D]
    doc = do_ref[pl.ds(r0, rows), :]
    lse = lse_ref[pl.ds(r0, rows)]
    dl = delta_ref[pl.ds(r0, rows)]
    segq = segq_ref[pl.ds(r0, rows)]
    tcol = (r0 + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)) // hp
    dt = tcol[None, :] - jrow[:, None]                              # t − j
    ok = ((dt >= 0) & (dt < window) & (segq[None, :] == segk[:, None])
          & (segk[:, None] > 0))
    s = _dot(k, qc, _NT) * scale                                    # [bkw, rows]
    p = jnp.where(ok, jnp.exp(s - lse[None, :]), 0.0)
    ds = p * (_dot(k, doc, _NT) - dl[None, :])
    return (dk + _dot(ds.astype(qc.dtype), qc, _NN) * scale
            + _dot(p.astype(doc.dtype), doc, _NN))

  # Unpadded queries (t_len: their count): the tiles past the last query are not read (each
  # would add exactly 0, as a padded tile does).
  n = n_q if t_len is None else jnp.minimum(n_q, (t_len - j0) // (rows // hp))
  dkv_ref[...] = jax.lax.fori_loop(0, n, chunk, jnp.zeros(k.shape, _F32))


def _entry_sum_kernel(lo_ref, hi_ref, order_ref, c_ref, o_ref, *, be):
  lo = jnp.min(lo_ref[...])
  hi = jnp.max(hi_ref[...])

  def chunk(i, acc):
    pos = lo + i * be + jax.lax.broadcasted_iota(jnp.int32, (be,), 0)
    ok = pos < hi
    idx = jnp.where(ok, order_ref[pl.ds(lo + i * be, be)], 0)
    return acc + jnp.where(ok[:, None], c_ref[idx, :].astype(_F32), 0.0)

  n = (hi - lo + be - 1) // be
  acc = jax.lax.fori_loop(0, n, chunk, jnp.zeros((be, o_ref.shape[-1]), _F32))
  o_ref[...] = jnp.sum(acc, axis=0)


# --- backward --------------------------------------------------------------------------------------

def _window_dkv(qp, dop, lse, delta, seg, kv, *, window, scale, hp, bkw, interpret, num_warps,
                num_stages, pad_queries: bool | None = None):
  """dK + dV of the window keys [B, T, D] float32 (key-outer band kernel). The query rows are
  read in place (the [B, T, Hp, D] arrays as [B, T·Hp, D], no copy) where whole tiles cover T,
  else padded to whole tiles past the last key block's window (`pad_queries`: None decides; the
  s3 step copied q and dO to [B, T + 192, 16, 128] per global layer, loop_pad_fusion at
  csa2_attention.py:418). The same sums either way."""
  B, T, _, D = qp.shape
  bt, n_q, tq = _band_rows(T, hp, window, bkw)      # tokens per tile, tiles, padded tokens
  rows = bt * hp
  nkb = -(-T // bkw)
  if pad_queries is None:
    pad_queries = bool(T % bt or bkw % bt)
  if not pad_queries:
    tq = T
  pad_q = lambda a, v=0: a if tq == T else jnp.pad(
      a, [(0, 0), (0, tq - T)] + [(0, 0)] * (a.ndim - 2), constant_values=v)
  q_flat = pad_q(qp).reshape(B, tq * hp, D)
  do_flat = pad_q(dop).reshape(B, tq * hp, D)
  lse_flat = pad_q(lse).reshape(B, tq * hp)
  delta_flat = pad_q(delta).reshape(B, tq * hp)
  segq = jnp.repeat(pad_q(seg.astype(jnp.int32), -1), hp, axis=1)
  kvp, segk = kv, seg.astype(jnp.int32)
  if nkb * bkw > T:
    kvp = jnp.pad(kvp, ((0, 0), (0, nkb * bkw - T), (0, 0)))
    segk = jnp.pad(segk, ((0, 0), (0, nkb * bkw - T)), constant_values=-1)
  row = lambda n: pl.BlockSpec((None, n, D), lambda b, j: (b, 0, 0))
  vec = lambda n: pl.BlockSpec((None, n), lambda b, j: (b, 0))
  kernel = functools.partial(_window_dkv_kernel, scale=scale, window=window, hp=hp, bkw=bkw,
                             rows=rows, n_q=n_q, t_len=None if pad_queries else T)
  dkv = pl.pallas_call(
      kernel, grid=(B, nkb),
      in_specs=[row(tq * hp), row(tq * hp), vec(tq * hp), vec(tq * hp), vec(tq * hp),
                row(nkb * bkw), vec(nkb * bkw)],
      out_specs=pl.BlockSpec((None, bkw, D), lambda b, j: (b, j, 0)),
      out_shape=jax.ShapeDtypeStruct((B, nkb * bkw, D), _F32),
      compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
      name="csa2_window_dkv")(q_flat, do_flat, lse_flat, delta_flat, segq, kvp, segk)
  return dkv[:, :T]


def _slot_order(ids, n_entries, bounds: str = "count", sort: str = "flat"):
  """The slots [B, R] (entry ids, −1 empty) sorted by entry, stable: (order [B, R] of row numbers,
  lo and hi [B, N, 16]: entry n's slots are order[lo[n]:hi[n]], in lanes of 16 copies that the
  kernel reads as a block and reduces to a scalar). `bounds`: "count" (a histogram of the ids,
  integer adds, and its running sum) or "search" (binary search of the sorted ids). `sort`:
  "rows" (one sort per batch row) or "flat" (one sort of all B·R slots, the row folded into the
  key); both give the same order. "flat" is the default: XLA on the GPU rewrites a 1-D stable
  key-value sort into CUB's radix sort (the s3 step's HLO of 2026-12-02b: `jnp.argsort`'s sorts
  are `cub_sort_pairs` custom calls), while the batched [B, R] sort stays its own sort fusion
  (5.1 ms per s3 step); 4 × 2^20 slots on the H200 with count bounds: 0.73 ms flat vs 1.74 ms
  rows (benchmarks/gpu_runs/2026-12-02/call2.log). "flat" falls back to "rows" where the folded
  keys or positions would reach 2^31."""
  B, R = ids.shape
  ids = jnp.where(ids >= 0, ids, n_entries).astype(jnp.int32)
  if sort == "flat" and max(B * (n_entries + 1), B * R) >= _MAX_ELEMS:
    sort = "rows"
  if sort == "rows":
    rank = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 1)
    sorted_ids, order = jax.lax.sort((ids, rank), dimension=1, is_stable=True, num_keys=1)
  elif sort == "flat":
    base = jnp.arange(B, dtype=jnp.int32)[:, None]
    keys, flat = jax.lax.sort(((ids + base * (n_entries + 1)).reshape(-1),
                               jnp.arange(B * R, dtype=jnp.int32)), is_stable=True, num_keys=1)
    sorted_ids = keys.reshape(B, R) - base * (n_entries + 1)
    order = flat.reshape(B, R) - base * R
  else:
    raise ValueError(f"sort must be 'rows' or 'flat' (got {sort!r})")
  if bounds == "count":
    rows = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    counts = jnp.zeros((B, n_entries + 1), jnp.int32).at[rows, ids].add(1)[:, :n_entries]
    hi = jnp.cumsum(counts, axis=1, dtype=jnp.int32)
    lo = hi - counts
  elif bounds == "search":
    entries = jnp.arange(n_entries, dtype=jnp.int32)
    search = lambda side: jax.vmap(lambda s: jnp.searchsorted(s, entries, side=side))(sorted_ids)
    lo, hi = search("left").astype(jnp.int32), search("right").astype(jnp.int32)
  else:
    raise ValueError(f"bounds must be 'count' or 'search' (got {bounds!r})")
  lanes = lambda a: jnp.broadcast_to(a[..., None], (B, n_entries, 16))
  return order, lanes(lo), lanes(hi)


def _entry_sums(contrib, order, lo, hi, *, be, interpret, num_warps, num_stages):
  """d(entries) [B, N, D] float32: Σ of contrib rows [B, R, D] over order[lo[n]:hi[n]], added in
  row order (one program per entry). Lanes past an entry's last slot add 0.0 (a select, not a
  padded zero row: padding contrib copied all of it, 1 GB per s3 indexer layer)."""
  B, R, D = contrib.shape
  n_entries = lo.shape[1]
  order = jnp.pad(order, ((0, 0), (0, be)))       # read past the last slot, never added
  bound = pl.BlockSpec((None, None, 16), lambda b, n: (b, n, 0))
  return pl.pallas_call(
      functools.partial(_entry_sum_kernel, be=be), grid=(B, n_entries),
      in_specs=[bound, bound, pl.BlockSpec((None, R + be), lambda b, n: (b, 0)),
                pl.BlockSpec((None, R, D), lambda b, n: (b, 0, 0))],
      out_specs=pl.BlockSpec((None, None, D), lambda b, n: (b, n, 0)),
      out_shape=jax.ShapeDtypeStruct((B, n_entries, D), _F32),
      compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
      name="csa2_entry_sums")(lo, hi, order, contrib)


def _piece_rows(B, T, plan, D, max_contrib_elems):
  """Query rows per piece: the slot contributions [B, P, G, Kp, D] stay under max_contrib_elems."""
  per_token = B * plan.g * plan.kp * D
  return max(1, min(T, max_contrib_elems // max(per_token, 1)))


def _piece_ids(topkp, g_n, t0, P):
  """The slot ids [B, P·G·Kp] of query rows t0 … t0 + P − 1, one copy per head group."""
  B, _, kp = topkp.shape
  return jnp.broadcast_to(topkp[:, t0:t0 + P, None, :], (B, P, g_n, kp)).reshape(B, -1)


def slot_plan(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT, sink_H, global_kv_BxNxD=None,
              topk_BxTxK=None, *, block_h: int | None = None, block_k_bwd: int | None = 64,
              bounds: str = "count", sort: str = "flat", max_contrib_elems: int = 1 << 29,
              **_) -> tuple | None:
  """The backward's slot order for this selection (the op's arguments; only the shapes of all
  but `topk_BxTxK` are read): per piece of query rows, `_slot_order` of its slots, (order
  [B, R], lo, hi [B, N, 16]); None without a global branch. A function of top-k alone, so the
  layers that read one selection (a Full or Reindex layer and its Reuse layers) compute it
  once and pass it to `sparse_attend(plan=...)` (the dispatcher's `plan`); the results are the
  bits of the kernel's own ordering. The pieces are those of the plan's batch size, which a
  batch shard keeps."""
  if global_kv_BxNxD is None:
    return None
  B, T, H, D = q_BxTxHxD.shape
  K, N = topk_BxTxK.shape[-1], global_kv_BxNxD.shape[1]
  plan = _sa._Plan(H, D, K, 1, block_h, block_k_bwd)
  topkp = jnp.pad(topk_BxTxK.astype(jnp.int32), ((0, 0), (0, 0), (0, plan.kp - K)),
                  constant_values=-1)
  piece = _piece_rows(B, T, plan, D, max_contrib_elems)
  return tuple(_slot_order(_piece_ids(topkp, plan.g, t0, min(piece, T - t0)), N, bounds, sort)
               for t0 in range(0, T, piece))


def _backward(q, kv, seg, sink, gkv, topk, o, lse, do, slots=None, *, window, scale, block_h,
              block_k, block_kw, block_e, sum_warps, bounds, sort, max_contrib_elems,
              contrib_dtype, interpret, num_warps, num_stages):
  B, T, H, D = q.shape
  has_global = gkv is not None
  K = topk.shape[-1] if has_global else 0
  N = gkv.shape[1] if has_global else 0
  plan = _sa._Plan(H, D, K, window, block_h, block_k)
  qp, kvp, segp, _, glob = _sa._prepare(q, kv, seg, sink, gkv, topk, plan)
  dop = jnp.pad(do.astype(q.dtype), ((0, 0), (0, 0), (0, plan.hp - H), (0, 0)))
  delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1)       # [B, T, H]
  deltap = jnp.pad(delta, ((0, 0), (0, 0), (0, plan.hp - H)))
  hb, g_n = plan.hb, plan.g
  if contrib_dtype is None:
    contrib_dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else _F32
  if not has_global:
    piece = T
  elif slots is not None:       # the plan's pieces (made for a batch at least this one's)
    piece = slots[0][0].shape[1] // (g_n * plan.kp)
    if len(slots) != -(-T // piece) or slots[0][1].shape[1] != N:
      raise ValueError(f"the slot plan ({len(slots)} pieces of {piece} rows, "
                       f"{slots[0][1].shape[1]} entries) was not made for {T} rows and {N} "
                       "entries")
  else:
    piece = _piece_rows(B, T, plan, D, max_contrib_elems)
  dq_parts, dg = [], None
  for i, t0 in enumerate(range(0, T, piece)):
    P = min(piece, T - t0)
    sl = lambda a: a[:, t0:t0 + P]
    tok = lambda *s: pl.BlockSpec((None, None) + s, lambda b, t, g: (b, t, g) + (0,) * (len(s) - 1))
    full_kv = pl.BlockSpec((None, T + plan.wb, D), lambda b, t, g: (b, 0, 0))
    full_seg = pl.BlockSpec((None, T + plan.wb), lambda b, t, g: (b, 0))
    in_specs = [tok(hb, D), tok(hb, D), tok(hb), tok(hb), full_kv, full_seg]
    args = [sl(qp), sl(dop), sl(lse), sl(deltap), kvp, segp]
    out_specs = [tok(hb, D)]
    out_shape = [jax.ShapeDtypeStruct((B, P, plan.hp, D), q.dtype)]
    if has_global:
      gkvp, topkp = glob
      in_specs += [pl.BlockSpec((None, N + 1, D), lambda b, t, g: (b, 0, 0)),
                   pl.BlockSpec((None, None, plan.kp), lambda b, t, g: (b, t, 0))]
      args += [gkvp, sl(topkp)]
      out_specs.append(pl.BlockSpec((None, None, None, plan.kp, D),
                                    lambda b, t, g: (b, t, g, 0, 0)))
      out_shape.append(jax.ShapeDtypeStruct((B, P, g_n, plan.kp, D), contrib_dtype))
    kernel = functools.partial(_dq_kernel, scale=scale, window=window, wb=plan.wb, bkw=plan.bkw,
                               bk=plan.bk, n_chunks=plan.n_chunks, t_off=t0,
                               has_global=has_global)
    outs = pl.pallas_call(
        kernel, grid=(B, P, g_n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
        name="csa2_dq")(*args)
    dq_parts.append(outs[0][:, :, :H])
    if has_global:
      order, lo, hi = (slots[i] if slots is not None
                       else _slot_order(_piece_ids(topkp, g_n, t0, P), N, bounds, sort))
      part = _entry_sums(outs[1].reshape(B, -1, D), order, lo, hi, be=block_e,
                         interpret=interpret, num_warps=sum_warps, num_stages=num_stages)
      dg = part if dg is None else dg + part
  dq = dq_parts[0] if len(dq_parts) == 1 else jnp.concatenate(dq_parts, axis=1)
  dkv = _window_dkv(qp, dop, lse, deltap, seg, kv, window=window, scale=scale, hp=plan.hp,
                    bkw=block_kw, interpret=interpret, num_warps=num_warps,
                    num_stages=num_stages)
  p_sink = jnp.exp(sink.astype(_F32)[None, None, :] - lse[..., :H])
  dsink = -jnp.sum(p_sink * delta, axis=(0, 1)).astype(sink.dtype)
  return (dq, dkv.astype(kv.dtype), dsink,
          None if dg is None else dg.astype(gkv.dtype))


# --- the op ----------------------------------------------------------------------------------------

_FWD_KEYS = ("window", "scale", "block_h", "block_k", "interpret", "num_warps", "num_stages",
             "with_probs")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attn(q, kv, seg, sink, gkv, topk, slots, static):
  return _attn_fwd(q, kv, seg, sink, gkv, topk, slots, static)[0]


def _attn_fwd(q, kv, seg, sink, gkv, topk, slots, static):
  st = dict(static)
  o, lse, probs, _ = _sa._forward(q, kv, seg, sink, gkv, topk, **{k: st[k] for k in _FWD_KEYS})
  # Named (`ops.sparse_attention.OUTPUT`): a remat policy that keeps them runs no second forward
  # kernel in the backward (the kernel is called through `jax.jit`, `sparse_attention._call`).
  o, lse, probs = checkpoint_name((o, lse, probs), OUTPUT)
  return (o, lse, probs), (q, kv, seg, sink, gkv, topk, slots, o, lse)


def _attn_bwd(static, res, cts):
  q, kv, seg, sink, gkv, topk, slots, o, lse = res
  do = cts[0]   # lse and global_probs are used only under stop_gradient: their cotangents are 0
  st = dict(static)
  st["block_k"] = st.pop("block_k_bwd")
  del st["with_probs"]
  dq, dkv, dsink, dg = _backward(q, kv, seg, sink, gkv, topk, o, lse, do, slots, **st)
  return dq, dkv, None, dsink, dg, None, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def sparse_attend(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT, sink_H, global_kv_BxNxD=None,
                  topk_BxTxK=None, *, window: int, scale: float, impl: str | None = None,
                  query_chunk: int | None = None, interpret: bool | None = None,
                  block_h: int | None = None, block_k: int | None = None,
                  block_k_bwd: int | None = 64, block_kw: int = 64, block_e: int = 16,
                  sum_warps: int = 4, bounds: str = "count", sort: str = "flat",
                  max_contrib_elems: int = 1 << 29, contrib_dtype=None, num_warps: int = 4,
                  num_stages: int = 2, fused_probs: bool = True, plan: tuple | None = None):
  """(o, global_probs) of `attend` (the op's arguments and results), deterministic backward.

  `impl`, `query_chunk`: the reference's XLA form and chunking, ignored (no such intermediate).
  `global_probs_BxTxK` carries no gradient (the model detaches it). Tiles: `block_k` selected
  slots per step in the forward (None: 64 for D ≤ 256, else 32), `block_k_bwd` in the dq kernel,
  `block_kw` window keys per band program, `block_e` contribution rows per step of an entry sum
  (`sum_warps` warps per entry program); `bounds` and `sort`: how the slots are ordered by entry
  (`_slot_order`; the same order either way).
  `contrib_dtype`: the slot contributions' storage (None: bfloat16 for bfloat16 inputs, which
  halves their traffic and rounds each (token, slot) term once before the float32 entry sums;
  float32 otherwise).
  `plan`: `slot_plan` of these arguments (with the same `block_h`, `block_k_bwd`, `bounds`,
  `sort`), computed once per selection and shared; None computes it in the backward.
  `fused_probs`: the forward kernel writes global_probs from the scores it already holds (True),
  or a second kernel recomputes them from lse, gathering the selected keys again (False; the
  s3 step's 36 such calls, its forward and the remat's, took 8.7 ms on the H200). The same sums.
  """
  del impl, query_chunk
  if (global_kv_BxNxD is None) != (topk_BxTxK is None):
    raise ValueError("global_kv_BxNxD and topk_BxTxK must be given together")
  if (reason := unsupported_reason(q_BxTxHxD, swa_kv_BxTxD, window=window,
                                   block_kw=block_kw)) is not None:
    raise ValueError(f"csa2_attention kernel: {reason}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  static = (("window", int(window)), ("scale", float(scale)), ("block_h", block_h),
            ("block_k", block_k), ("block_k_bwd", block_k_bwd), ("block_kw", int(block_kw)),
            ("block_e", int(block_e)), ("sum_warps", int(sum_warps)), ("bounds", bounds),
            ("sort", sort),
            ("max_contrib_elems", int(max_contrib_elems)),
            ("contrib_dtype", None if contrib_dtype is None else jnp.dtype(contrib_dtype)),
            ("interpret", bool(interpret)), ("num_warps", num_warps), ("num_stages", num_stages),
            ("with_probs", bool(fused_probs)))
  if plan is not None and global_kv_BxNxD is None:
    raise ValueError("a slot plan belongs to a global branch; this call has none")
  o, lse, probs = _attn(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT, sink_H, global_kv_BxNxD,
                        topk_BxTxK, plan, static)
  if global_kv_BxNxD is None:
    return o, None
  sg = jax.lax.stop_gradient
  if fused_probs:
    return o, sg(probs)
  probs = _sa._global_probs(sg(q_BxTxHxD), sg(global_kv_BxNxD), topk_BxTxK, sg(lse), scale=scale,
                            block_h=block_h, block_k=block_k, interpret=bool(interpret),
                            num_warps=num_warps, num_stages=num_stages)
  return o, probs
