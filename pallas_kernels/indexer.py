"""CSA2 lightning-indexer scores and top-k without the [T, H_I, N] logits (docs/design.md §5.4, §14).

The kernel of the op `indexer_topk` (`indexer_topk` here): restates
`pallas_kernels.ops.indexer.score_and_select` without a candidate pool (tests compare the two):

  I[t, n] = Σ_h w[t, h] · ReLU(q[t, h] · k[n]) · D_I^{-1/2}      visible(t, n), else −∞
  visible = entry_last[n] ≤ t  ∧  entry_segment[n] == segment[t] > 0
  topk[t] = argtop_K I[t, ·] (−1 where fewer are visible);  scores_at_topk = I at those slots

`masked_scores` is the kernel: one program per (batch row, `block_t` queries) loops over the
entries in blocks of `block_n`; for each block it runs one [block_t, D_I] · [D_I, block_n] dot
per index head and folds ReLU and the head weight into a float32 [block_t, block_n] accumulator
in registers, then applies the visibility mask and writes the block of I. Entry blocks past the
last one complete by the query block's last row (entries are in order, `entry_last`
non-decreasing, as the compressor emits them) are written −∞ without a dot. So memory sees I
[T, N] float32 once, never the logits [T, H_I, N].

Selection is the exact radix threshold select (the set `lax.top_k` picks, ties to the lowest
index, in ascending index order) over I, in chunks of rows that keep I under `max_score_bytes`:
one Triton program per row (`pallas_kernels.topk_triton`) where it holds the row, else the XLA form
(`pallas_kernels.topk_select.radix_topk`); the two give the same slots.
`scores_at_topk` is recomputed from the K selected entries by two more Triton kernels, one
program per query gathering its selected keys by index (`scores_at`, in chunks of `query_chunk`
rows): that is the indexer KL loss's gradient path to q, w and the index keys, through the K
selected entries only (`scores_at`'s backward: dq and dw per query in registers, the keys'
gradient summed per entry after a sort of the slots, not scattered); the scores kernel itself is
forward only.

Backend: Triton via `pl.pallas_call` with explicit `plt.CompilerParams`; `interpret=True` on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels import csa2_attention as _ca
from pallas_kernels.ops import indexer as _ops
from pallas_kernels.topk_select import radix_topk
from pallas_kernels.topk_triton import MAX_ENTRIES as _TRITON_MAX_ENTRIES, triton_topk

_SELECTS = {"radix": radix_topk, "triton": triton_topk,
            "triton_early": functools.partial(triton_topk, early_exit=True)}

_F32 = jnp.float32


def _triton_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def unsupported_reason(q_BxTxHxI, w_BxTxH, index_k_BxNxI, entry_segment_BxN, entry_last_BxN,
                       segment_ids_BxT, candidate=None, *, make_pool: bool = False,
                       **_) -> str | None:
  """Why the kernel cannot take the op's arguments (None if it can)."""
  if make_pool or candidate is not None:
    return "the candidate pool (docs/design.md §5.6) has no kernel"
  d = q_BxTxHxI.shape[-1]
  if d < 16 or d & (d - 1):
    return f"index_head_dim {d} is not a power of two ≥ 16 (Triton blocks)"
  if q_BxTxHxI.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f"dtype {q_BxTxHxI.dtype} is not bfloat16, float16 or float32"
  if index_k_BxNxI.dtype != q_BxTxHxI.dtype:
    return f"q ({q_BxTxHxI.dtype}) and index_k ({index_k_BxNxI.dtype}) dtypes differ"
  return None


def _scores_kernel(nb_ref, q_ref, w_ref, k_ref, last_ref, eseg_ref, seg_ref, rows_ref, o_ref, *,
                   n_heads, block_n, n_blocks, scale):
  """One query block × one chunk of `n_blocks` entry blocks (the chunk is program axis 2)."""
  seg = seg_ref[...]                                    # [bt]
  rows = rows_ref[...]                                  # [bt] row index of each query
  bt = seg.shape[0]
  prec = jax.lax.Precision.HIGHEST if q_ref.dtype == _F32 else None
  # Entry blocks of this chunk with an entry complete by the block's last row.
  n_live = jnp.clip(jnp.max(nb_ref[...]) - pl.program_id(2) * n_blocks, 0, n_blocks)

  # Loops carry their (unused) input through: a constant carry fails the Triton lowering of a
  # loop with a run-time bound ("scf.yield ... is not a Value", seen on jax 0.11.2).
  def block(j, carry):
    cols = pl.ds(j * block_n, block_n)
    k = k_ref[cols, :]                                  # [bn, I]

    def head(h, acc):
      s = jax.lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())), precision=prec,
                              preferred_element_type=_F32)              # [bt, bn]
      return acc + w_ref[h][:, None] * jnp.maximum(s, 0.0)

    acc = jax.lax.fori_loop(0, n_heads, head, jnp.zeros((bt, block_n), _F32))
    ok = ((last_ref[cols][None, :] <= rows[:, None]) & (eseg_ref[cols][None, :] == seg[:, None])
          & (seg[:, None] > 0))
    o_ref[:, cols] = jnp.where(ok, acc * scale, -jnp.inf)
    return carry

  def dead(j, carry):
    o_ref[:, pl.ds(j * block_n, block_n)] = jnp.full((bt, block_n), -jnp.inf, _F32)
    return carry

  jax.lax.fori_loop(0, n_live, block, n_live)
  jax.lax.fori_loop(n_live, n_blocks, dead, n_live)


@functools.partial(jax.jit, static_argnames=("block_t", "block_n", "block_chunk", "interpret",
                                             "num_warps", "num_stages"))
def masked_scores(q_BxTxHxI, w_BxTxH, index_k_BxNxI, entry_segment_BxN, entry_last_BxN,
                  segment_ids_BxT, rows_T, *, block_t: int = 64, block_n: int = 128,
                  block_chunk: int | None = None, interpret: bool = False, num_warps: int = 4,
                  num_stages: int = 2):
  """I [B, T, N] float32, −∞ where invisible, for queries at row indices `rows_T` (ascending).

  One program scores a block of `block_t` queries against `block_chunk` entries (a multiple of
  `block_n`; None: every entry, one program a query block), `block_n` at a time, and writes −∞
  over the entry blocks no query of its block sees yet; a chunk larger than the (padded) row is
  the row, one smaller than an entry block is one block. Causally a row's live blocks grow with
  its position, so whole-row programs range from one live block to all of them: at s3's 4 × 4096
  that is 256 programs for 132 SMs, the last query blocks 32 live blocks against 16.5 on average.
  Chunks give more, more even programs (the dead chunks only write −∞): at s3's shape on an H100
  the scores took 0.85 ms in chunks of 512 entries against 1.17 whole-row (1,024: 0.91, 2,048:
  1.00; session 59, `benchmarks/csa2_kernels_gpu.py --cases idx-4k-chunks`), so `score_and_select`
  passes 512.

  Tiles: at s3's 4 × 4096, 16 heads × 128, ratio 1 on the H200, 64 queries × 128 entries with 4
  warps scored in 1.13 ms, against 1.49 for 64 × 64 and 1.32-1.89 for the four other tiles
  measured (benchmarks/RESULTS.md, 2026-12-04). The tile changes only the dots' float32 rounding
  (`tests/pallas_kernels/test_indexer.py` checks two tilings against the reference).
  """
  B, T, H, I = q_BxTxHxI.shape
  N = index_k_BxNxI.shape[1]
  whole = block_n * -(-N // block_n)
  if block_chunk is not None and int(block_chunk) > block_n and int(block_chunk) % block_n:
    raise ValueError(f"indexer scores: block_chunk {block_chunk} is not a multiple of block_n "
                     f"{block_n}")
  chunk = whole if block_chunk is None else min(max(int(block_chunk), block_n), whole)
  tp = -(-T // block_t) * block_t
  nc = -(-N // chunk)
  np_ = nc * chunk
  nq = tp // block_t
  big = jnp.iinfo(jnp.int32).max
  q = jnp.pad(jnp.swapaxes(q_BxTxHxI, 1, 2), ((0, 0), (0, 0), (0, tp - T), (0, 0)))   # [B,H,Tp,I]
  w = jnp.pad(jnp.swapaxes(w_BxTxH.astype(_F32), 1, 2), ((0, 0), (0, 0), (0, tp - T)))
  k = jnp.pad(index_k_BxNxI, ((0, 0), (0, np_ - N), (0, 0)))
  last = jnp.pad(entry_last_BxN.astype(jnp.int32), ((0, 0), (0, np_ - N)), constant_values=big)
  eseg = jnp.pad(entry_segment_BxN.astype(jnp.int32), ((0, 0), (0, np_ - N)), constant_values=-1)
  seg = jnp.pad(segment_ids_BxT.astype(jnp.int32), ((0, 0), (0, tp - T)))
  rows = jnp.pad(rows_T.astype(jnp.int32), (0, tp - T), mode="edge")
  # Entry blocks that hold an entry complete by each query block's last row (a vector of 16
  # copies: the kernel reads it as a block and takes its max).
  t_last = rows.reshape(nq, block_t)[:, -1]
  live = jnp.sum(last[:, None, :] <= t_last[None, :, None], axis=-1, dtype=jnp.int32)  # [B, nq]
  n_live = jnp.broadcast_to((-(-live // block_n))[..., None], (B, nq, 16))
  kernel = functools.partial(_scores_kernel, n_heads=H, block_n=block_n,
                             n_blocks=chunk // block_n, scale=I ** -0.5)
  out = pl.pallas_call(
      kernel,
      grid=(B, nq, nc),
      in_specs=[pl.BlockSpec((None, None, 16), lambda b, i, c: (b, i, 0)),
                pl.BlockSpec((None, H, block_t, I), lambda b, i, c: (b, 0, i, 0)),
                pl.BlockSpec((None, H, block_t), lambda b, i, c: (b, 0, i)),
                pl.BlockSpec((None, chunk, I), lambda b, i, c: (b, c, 0)),
                pl.BlockSpec((None, chunk), lambda b, i, c: (b, c)),
                pl.BlockSpec((None, chunk), lambda b, i, c: (b, c)),
                pl.BlockSpec((None, block_t), lambda b, i, c: (b, i)),
                pl.BlockSpec((block_t,), lambda b, i, c: (i,))],
      out_specs=pl.BlockSpec((None, block_t, chunk), lambda b, i, c: (b, i, c)),
      out_shape=jax.ShapeDtypeStruct((B, tp, np_), _F32),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret,
      name="indexer_scores",
  )(n_live, q, w, k, last, eseg, seg, rows)
  return out[:, :T, :N]


def _selected_logits(q_BxTxHxI, index_k_BxNxI, topk_BxTxK):
  """(the selected keys [B, T, K, I], q · k at them [B, T, H, K] float32)."""
  k_sel = jax.vmap(lambda k_b, i_b: k_b[i_b])(index_k_BxNxI, jnp.maximum(topk_BxTxK, 0))
  return k_sel, jnp.einsum("bthi,btki->bthk", q_BxTxHxI, k_sel, preferred_element_type=_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def scores_at_xla(q_BxTxHxI, w_BxTxH, index_k_BxNxI, topk_BxTxK, interpret: bool = False):
  """`scores_at` in XLA (the form before the Triton kernels; benchmarks time the two side by
  side): gathers the selected keys [B, T, K, I] and writes them, the float32 logits and each
  slot's keys' gradient [B, T, K, I] to memory, forward and backward."""
  return _scores_at_xla_fwd(q_BxTxHxI, w_BxTxH, index_k_BxNxI, topk_BxTxK, interpret)[0]


def _scores_at_xla_fwd(q, w, k, topk, interpret):
  _, logits = _selected_logits(q, k, topk)
  s = jnp.einsum("bthk,bth->btk", jax.nn.relu(logits), w.astype(_F32)) * (q.shape[-1] ** -0.5)
  return jnp.where(topk >= 0, s, 0.0), (q, w, k, topk)


def _scores_at_xla_bwd(interpret, res, g_BxTxK):
  q, w, k, topk = res
  B, T, H, I = q.shape
  k_sel, logits = _selected_logits(q, k, topk)
  c = jnp.where(topk >= 0, g_BxTxK, 0.0) * (I ** -0.5)                # [B, T, K]
  dw = jnp.einsum("bthk,btk->bth", jax.nn.relu(logits), c)
  a = jnp.where(logits > 0, w.astype(_F32)[..., None] * c[:, :, None, :], 0.0).astype(q.dtype)
  dq = jnp.einsum("bthk,btki->bthi", a, k_sel, preferred_element_type=_F32)
  contrib = jnp.einsum("bthk,bthi->btki", a, q, preferred_element_type=_F32)   # [B, T, K, I]
  dk = _key_grad(contrib.astype(_contrib_dtype(q.dtype)), topk, k.shape[1], interpret)
  return dq.astype(q.dtype), dw.astype(w.dtype), dk.astype(k.dtype), None


scores_at_xla.defvjp(_scores_at_xla_fwd, _scores_at_xla_bwd)


def _contrib_dtype(dtype):
  return jnp.bfloat16 if dtype == jnp.bfloat16 else _F32


def _key_grad(contrib_BxTxKxI, topk_BxTxK, n_entries, interpret):
  """dk [B, N, I] float32: each slot's contribution summed at its entry (−1 slots dropped), by
  csa2_attention's entry-sum kernel after a stable sort of the slots (no scatter, no atomics)."""
  B, T, K, I = contrib_BxTxKxI.shape
  order, lo, hi = _ca._slot_order(topk_BxTxK.reshape(B, T * K), n_entries)
  return _ca._entry_sums(contrib_BxTxKxI.reshape(B, T * K, I), order, lo, hi, be=16,
                         interpret=interpret, num_warps=4, num_stages=2)


def _pow2_at_least(n: int, lo: int) -> int:
  return max(lo, 1 << (max(n, 1) - 1).bit_length())


def _sel_fwd_kernel(q_ref, w_ref, topk_ref, k_ref, s_ref, *, bk, n_chunks, scale):
  q = q_ref[...]                                                  # [hp, I]
  w = w_ref[...]                                                  # [hp] float32
  for c in range(n_chunks):
    idx = topk_ref[pl.ds(c * bk, bk)]
    k = k_ref[jnp.maximum(idx, 0), :]                             # [bk, I] gathered rows
    l = _ca._dot(q, k, _ca._NT)                                   # [hp, bk] float32
    s = jnp.sum(w[:, None] * jnp.maximum(l, 0.0), axis=0) * scale
    s_ref[pl.ds(c * bk, bk)] = jnp.where(idx >= 0, s, 0.0)


def _sel_bwd_kernel(q_ref, w_ref, topk_ref, g_ref, k_ref, dq_ref, dw_ref, c_ref, *, bk, n_chunks,
                    scale):
  q = q_ref[...]
  w = w_ref[...]

  def chunk(c, carry):
    dq, dw = carry
    idx = topk_ref[pl.ds(c * bk, bk)]
    k = k_ref[jnp.maximum(idx, 0), :]
    l = _ca._dot(q, k, _ca._NT)                                   # [hp, bk]
    g = jnp.where(idx >= 0, g_ref[pl.ds(c * bk, bk)], 0.0) * scale
    dw = dw + jnp.sum(jnp.maximum(l, 0.0) * g[None, :], axis=1)
    a = jnp.where(l > 0, w[:, None] * g[None, :], 0.0).astype(q.dtype)
    c_ref[pl.ds(c * bk, bk), :] = _ca._dot(a, q, _ca._TN).astype(c_ref.dtype)   # [bk, I]
    return dq + _ca._dot(a, k, _ca._NN), dw

  hp, d = q.shape
  dq, dw = jax.lax.fori_loop(0, n_chunks, chunk,
                             (jnp.zeros((hp, d), _F32), jnp.zeros((hp,), _F32)))
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dw_ref[...] = dw


def _sel_layout(q, w, topk, block_k):
  """q, w with the heads padded to hp (a power of two ≥ 16: Triton dot tiles; zero weights add
  nothing), top-k with the slots padded to Kp = a multiple of bk (−1), and (hp, bk, Kp)."""
  B, T, H, I = q.shape
  K = topk.shape[-1]
  hp = _pow2_at_least(H, 16)
  bk = min(block_k, _pow2_at_least(K, 16))
  kp = -(-K // bk) * bk
  if hp != H:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - H), (0, 0)))
  w = jnp.pad(w.astype(_F32), ((0, 0), (0, 0), (0, hp - H)))
  topk = jnp.pad(topk.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - K)), constant_values=-1)
  return q, w, topk, hp, bk, kp


_SEL_STATIC = ("block_k", "interpret", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_SEL_STATIC)
def _scores_at_kernel_fwd(q, w, k, topk, *, block_k, interpret, num_warps, num_stages):
  B, T, H, I = q.shape
  N, K = k.shape[1], topk.shape[-1]
  qp, wp, tp, hp, bk, kp = _sel_layout(q, w, topk, block_k)
  tok = lambda *s: pl.BlockSpec((None, None) + s, lambda b, t: (b, t) + (0,) * len(s))
  s = pl.pallas_call(
      functools.partial(_sel_fwd_kernel, bk=bk, n_chunks=kp // bk, scale=I ** -0.5),
      grid=(B, T),
      in_specs=[tok(hp, I), tok(hp), tok(kp), pl.BlockSpec((None, N, I), lambda b, t: (b, 0, 0))],
      out_specs=tok(kp),
      out_shape=jax.ShapeDtypeStruct((B, T, kp), _F32),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret, name="indexer_at_topk")(qp, wp, tp, k)
  return s[..., :K]


@functools.partial(jax.jit, static_argnames=_SEL_STATIC)
def _scores_at_kernel_bwd(q, w, k, topk, g, *, block_k, interpret, num_warps, num_stages):
  B, T, H, I = q.shape
  N, K = k.shape[1], topk.shape[-1]
  qp, wp, tp, hp, bk, kp = _sel_layout(q, w, topk, block_k)
  gp = jnp.pad(g.astype(_F32), ((0, 0), (0, 0), (0, kp - K)))
  tok = lambda *s: pl.BlockSpec((None, None) + s, lambda b, t: (b, t) + (0,) * len(s))
  dq, dw, contrib = pl.pallas_call(
      functools.partial(_sel_bwd_kernel, bk=bk, n_chunks=kp // bk, scale=I ** -0.5),
      grid=(B, T),
      in_specs=[tok(hp, I), tok(hp), tok(kp), tok(kp),
                pl.BlockSpec((None, N, I), lambda b, t: (b, 0, 0))],
      out_specs=[tok(hp, I), tok(hp), tok(kp, I)],
      out_shape=[jax.ShapeDtypeStruct((B, T, hp, I), q.dtype),
                 jax.ShapeDtypeStruct((B, T, hp), _F32),
                 jax.ShapeDtypeStruct((B, T, kp, I), _contrib_dtype(q.dtype))],
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret, name="indexer_at_topk_bwd")(qp, wp, tp, gp, k)
  dk = _key_grad(contrib, tp, N, interpret)
  return dq[:, :, :H], dw[..., :H], dk


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def scores_at(q_BxTxHxI, w_BxTxH, index_k_BxNxI, topk_BxTxK, interpret: bool = False,
              block_k: int = 128, num_warps: int = 4, num_stages: int = 2):
  """I at the selected entries [B, T, K] float32 (0 at empty slots), differentiable in q, w, k.

  The backward reads the K selected entries only (the indexer KL loss's gradient lives there):
  with c = g · D_I^{-1/2} at the valid slots and l = q · k_sel,
    dw_{t,h} = Σ_k c_{t,k} ReLU(l_{t,h,k}),   a_{t,h,k} = c_{t,k} w_{t,h} [l_{t,h,k} > 0]
    dq_{t,h} = Σ_k a_{t,h,k} k_sel_{t,k},     dk_n = Σ_{(t,k): topk = n} Σ_h a_{t,h,k} q_{t,h}
  Two Triton kernels, one program per query, its heads the rows of each tile: the forward
  gathers the query's selected keys `block_k` slots at a time ([bk, I] rows read by index) and
  writes the K scores; the backward gathers them again, keeps dq and dw in registers and writes
  each slot's key gradient Σ_h a q [Kp, I] (bfloat16 for bfloat16 inputs). Nothing [K, I] or
  [H, K] per query is written in the forward. dk's sum over the slots that name an entry runs as
  the attention kernel's: the slots sorted by entry, one program per entry adding its rows in
  order (no scatter, no atomics; `pallas_kernels.csa2_attention`). `scores_at_xla` is the XLA
  form of the same function.

  `block_k` 128 (4 warps): on the H100 at s3's shapes (4 × 4096, H_I 16 × 128, top-256) 0.72 ms
  forward and 2.84 ms forward + backward against 0.83 / 3.09 at 64, 0.81 / 2.87 at 32 and
  0.78 / 3.35 at 64 with 8 warps (benchmarks/RESULTS.md, session 58)."""
  return _scores_at_kernel_fwd(q_BxTxHxI, w_BxTxH, index_k_BxNxI, topk_BxTxK, block_k=block_k,
                               interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def _scores_at_fwd(q, w, k, topk, interpret, block_k, num_warps, num_stages):
  s = _scores_at_kernel_fwd(q, w, k, topk, block_k=block_k, interpret=interpret,
                            num_warps=num_warps, num_stages=num_stages)
  return s, (q, w, k, topk)


def _scores_at_bwd(interpret, block_k, num_warps, num_stages, res, g_BxTxK):
  q, w, k, topk = res
  dq, dw, dk = _scores_at_kernel_bwd(q, w, k, topk, g_BxTxK, block_k=block_k,
                                     interpret=interpret, num_warps=num_warps,
                                     num_stages=num_stages)
  return dq, dw.astype(w.dtype), dk.astype(k.dtype), None


scores_at.defvjp(_scores_at_fwd, _scores_at_bwd)


def _row_chunks(fn, t: int, chunk: int, xs):
  """fn over rows in chunks of `chunk` (lax.map, rematerialised); xs: arrays [B, T, ...] or [T]."""
  if chunk >= t:
    return fn(*xs)
  nc = -(-t // chunk)
  pad = nc * chunk - t

  def split(a):
    lead = 0 if a.ndim == 1 else 1
    a = jnp.pad(a, [(0, 0)] * lead + [(0, pad)] + [(0, 0)] * (a.ndim - lead - 1),
                mode="edge" if a.ndim == 1 else "constant")
    a = a.reshape(*a.shape[:lead], nc, chunk, *a.shape[lead + 1:])
    return jnp.moveaxis(a, lead, 0)

  out = jax.lax.map(jax.checkpoint(lambda a: fn(*a)), tuple(split(a) for a in xs))

  def join(a):
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape(a.shape[0], nc * chunk, *a.shape[3:])[:, :t]

  return jax.tree.map(join, out)


def score_and_select(q_BxTxHxI, w_BxTxH, index_k_BxNxI, entry_segment_BxN, entry_last_BxN,
                     segment_ids_BxT, *, k: int, query_chunk: int | None = 512,
                     max_score_bytes: int = 1 << 31, max_slot_bytes: int = 1 << 31,
                     interpret: bool | None = None,
                     block_t: int = 64, block_n: int = 128, block_chunk: int | None = 512,
                     num_warps: int = 4, num_stages: int = 2, select: str = "auto"):
  """(topk_BxTxK int32, scores_at_topk_BxTxK float32): the kernel's form of the model function.

  The selection runs on I from the kernel (no gradient); `scores_at_topk` is recomputed from the
  selected entries (`scores_at`) and carries the gradient to q, w and index_k. `scores_at` runs
  over chunks of at least `query_chunk` rows (None: the whole row), as many more as keep one
  chunk's slot gradients [B, rows, Kp, I] within `max_slot_bytes` (fewer chunks: fewer kernels a
  step; at s3's 4 × 4096 the whole row, 1.3 GB, was 2.7 % faster a train step than chunks of 512,
  benchmarks/RESULTS.md), equal chunks, never one whose slot gradients reach 2^31 elements
  (Triton's 32-bit offsets). `select`: "radix" (the XLA
  radix select, `pallas_kernels.topk_select`), "triton" (the same slots from one Triton program
  per row, `pallas_kernels.topk_triton`: 0.95 ms against the radix select's 4.57 and
  `lax.top_k`'s 4.26 at 4 × 4,096 × top-256 on the H200, RESULTS.md), "triton_early" (the
  Triton select stopping its digits once the prefix isolates the K-th key,
  `triton_topk(early_exit=True)`: 0.82 ms against 0.94 on an H100, session 59) or "auto"
  (triton_early where one program holds the row's N entries, radix beyond). Every choice selects
  the same slots. `block_chunk`: `masked_scores`' entry chunk (512: scores + selection 1.59 ms
  against 1.89 whole-row with the early-exit select, 5.6x the XLA reference's forward, and s3's
  accumulated step 2,213.5 against 2,236.2 ms with both; H100, session 59).
  """
  B, T, H, I = q_BxTxHxI.shape
  N = index_k_BxNxI.shape[1]
  if select == "auto":
    select = "triton_early" if N <= _TRITON_MAX_ENTRIES else "radix"
  if select not in _SELECTS:
    raise ValueError(f"indexer kernel: select {select!r} is not one of "
                     f"{sorted(_SELECTS) + ['auto']}")
  topk_of = _SELECTS[select]
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  k_eff = min(k, N)
  sg = jax.lax.stop_gradient
  qs, ws, ks = sg(q_BxTxHxI), sg(w_BxTxH), sg(index_k_BxNxI)
  # The Triton select reads the masked scores and makes its keys in the kernel (visible =
  # score > −inf, as the radix select is told): no key array and no visible count in memory.
  keys_in_kernel = select.startswith("triton")

  def scored_selection(q, w, seg, rows):
    s = masked_scores(q, w, ks, entry_segment_BxN, entry_last_BxN, seg, rows, block_t=block_t,
                      block_n=block_n, block_chunk=block_chunk, interpret=interpret,
                      num_warps=num_warps,
                      num_stages=num_stages)
    return topk_of(s, None if keys_in_kernel else s > -jnp.inf, k_eff)

  rows_per_chunk = max(block_t, (max_score_bytes // (4 * B * N)) // block_t * block_t)
  topk = _row_chunks(scored_selection, T, rows_per_chunk,
                     (qs, ws, segment_ids_BxT, jnp.arange(T, dtype=jnp.int32)))
  slot_row = B * (k_eff + 64) * I                                   # Kp ≤ K + 63
  c = T if not query_chunk else max(int(query_chunk), max_slot_bytes // (
      slot_row * jnp.dtype(_contrib_dtype(q_BxTxHxI.dtype)).itemsize))
  c = max(1, min(c, T, ((1 << 31) - 1) // slot_row))
  c = -(-T // -(-T // c))                                           # equal chunks
  picked = _row_chunks(lambda q, w, i: scores_at(q, w, index_k_BxNxI, i, interpret), T, c,
                       (q_BxTxHxI, w_BxTxH, topk))
  return topk, checkpoint_name(picked, _ops.SELECTION)


def indexer_topk(q_BxTxHxI, w_BxTxH, index_k_BxNxI, entry_segment_BxN, entry_last_BxN,
                 segment_ids_BxT, candidate=None, *, k: int, make_pool: bool = False,
                 block_size: int = 8, topk_blocks: int = 1, query_chunk: int | None = 512,
                 **kernel_options):
  """The op's kernel: `score_and_select` with the op's arguments and results (pool None)."""
  del block_size, topk_blocks  # the candidate pool's; the kernel has none
  if (reason := unsupported_reason(q_BxTxHxI, w_BxTxH, index_k_BxNxI, entry_segment_BxN,
                                   entry_last_BxN, segment_ids_BxT, candidate,
                                   make_pool=make_pool)):
    raise ValueError(f"indexer kernel: {reason}")
  topk, picked = score_and_select(q_BxTxHxI, w_BxTxH, index_k_BxNxI, entry_segment_BxN,
                                  entry_last_BxN, segment_ids_BxT, k=k, query_chunk=query_chunk,
                                  **kernel_options)
  return topk, picked, None
