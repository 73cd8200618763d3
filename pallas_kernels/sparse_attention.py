"""Sparse attention's forward kernels: window ∪ selected entries ∪ sink, online softmax (docs/design.md §4.3, §14).

The forward half of the op `sparse_attention`'s kernel (`pallas_kernels.csa2_attention`, which
adds the deterministic backward and is what the dispatcher registers): restates
`pallas_kernels.ops.sparse_attention.attend` as Pallas kernels that never build the [B, T, K, D]
gather nor score all N entries. For query t, head h:

  keys   = window rows j ∈ [t − W + 1, t] with segment[j] == segment[t] > 0
         ∪ the entries topk[t, s] ≥ 0 (read by index straight from global_kv; K = V, one head)
  o      = Σ_j softmax_j(s_{t,h,j} ∪ sink_h) · k_j,   s = (q·k)·scale,  the sink takes mass only

One program per (batch, query token, group of `block_h` heads). Every head of a token reads the
same keys (MQA), so the heads are the M dimension of each tensor-core dot: s [Hb, bk] = q [Hb, D] ·
keys [bk, D]ᵀ, then an online softmax (running max starts at the sink, running sum at 1 =
exp(sink − sink)) streams first the window, in chunks of bk rows, then the selected slots, bk at
a time, loaded with a gather of whole D-rows. Heads are padded to a power of two ≥ 16 (zero
queries; their outputs are dropped and their gradients are zero).

Kernels:
  `_fwd`    o [B, T, H, D] and lse [B, T, H] (log of the softmax denominator, sink included).
  `_probs`  global_probs [B, T, K]: Σ_h exp(s − lse) at each selected slot, recomputed from lse
            (a separate call, so a consumer that drops it costs nothing). Its inputs are
            stop_gradient'ed: the model uses it only as the detached indexer-loss target.
            `_fwd` with `with_probs` writes the same sums itself: its selected-slot chunks are
            unrolled and their scores kept until lse is known, so no key is gathered twice.
A repeated slot in a row counts twice (as `attend`'s "gather" form; `lax.top_k` makes them
distinct).

Backend: Triton via `pl.pallas_call` with explicit `plt.CompilerParams`; `interpret=True` on CPU.
Shapes the kernels cannot take are named by `unsupported_reason`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))      # a · bᵀ
_TN = (((0,), (0,)), ((), ()))      # aᵀ · b


def _triton_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(v: int) -> int:
  return 1 << max(0, (int(v) - 1).bit_length())


def unsupported_reason(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT, sink_H, global_kv_BxNxD=None,
                       topk_BxTxK=None, *, window: int, **_) -> str | None:
  """Why the kernel cannot take the op's arguments (None if it can)."""
  D = q_BxTxHxD.shape[-1]
  if D < 16 or D & (D - 1):
    return f"head_dim {D} is not a power of two ≥ 16 (Triton blocks)"
  if q_BxTxHxD.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f"dtype {q_BxTxHxD.dtype} is not bfloat16, float16 or float32"
  if swa_kv_BxTxD.dtype != q_BxTxHxD.dtype:
    return f"q ({q_BxTxHxD.dtype}) and kv ({swa_kv_BxTxD.dtype}) dtypes differ"
  if window < 1:
    return f"window {window} < 1"
  return None


def _dot(a, b, dims):
  prec = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
  return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=_F32)


# --- kernels ---------------------------------------------------------------------------------------

def _window_rows(t, c, wb: int, bkw: int, window: int, seg_ref, seg_t):
  """Padded row start of window chunk c of token t and its visibility [bkw]."""
  start = t + 1 + c * bkw                       # key j = t − wb + 1 + c·bkw + i sits at row j + wb
  segk = seg_ref[pl.ds(start, bkw)]
  delta = (wb - 1 - c * bkw) - jax.lax.broadcasted_iota(jnp.int32, (bkw,), 0)   # t − j ≥ 0
  ok = (delta < window) & (segk == seg_t) & (seg_t > 0)
  return start, ok


def _fwd_kernel(q_ref, kv_ref, seg_ref, sink_ref, *rest, scale, window, wb, bkw, bk, n_chunks,
                has_global, n_heads=None, hb=None):
  with_probs = n_heads is not None
  if has_global:
    gkv_ref, topk_ref, o_ref, lse_ref, *p_ref = rest
  else:
    o_ref, lse_ref = rest
  t = pl.program_id(1)
  q = q_ref[...]                                                    # [Hb, D]
  seg_t = seg_ref[pl.ds(t + wb, 1)]                                 # [1]
  sink = sink_ref[...]                                              # [Hb] f32

  def update(carry, k, ok, s=None):
    m, l, acc = carry
    if s is None:
      s = _dot(q, k, _NT) * scale                                   # [Hb, bk]
    s = jnp.where(ok[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    # Rounded once to the values' dtype; numerator and denominator sum the rounded values
    # (as `attend` does).
    p = jnp.exp(s - m_new[:, None]).astype(k.dtype)
    l = l * alpha + jnp.sum(p.astype(_F32), axis=1)
    acc = acc * alpha[:, None] + _dot(p, k, (((1,), (0,)), ((), ())))
    return m_new, l, acc

  def window_chunk(c, carry):
    start, ok = _window_rows(t, c, wb, bkw, window, seg_ref, seg_t)
    return update(carry, kv_ref[pl.ds(start, bkw), :], ok)

  carry = (sink, jnp.ones_like(sink), jnp.zeros(q.shape, _F32))
  carry = jax.lax.fori_loop(0, wb // bkw, window_chunk, carry)
  scores = []
  if has_global and with_probs:
    # Unrolled, so that each chunk's scores stay in registers until lse is known.
    for c in range(n_chunks):
      idx = topk_ref[pl.ds(c * bk, bk)]
      k = gkv_ref[jnp.maximum(idx, 0), :]
      scores.append((_dot(q, k, _NT) * scale, idx >= 0))
      carry = update(carry, k, scores[-1][1], scores[-1][0])
  elif has_global:
    def global_chunk(c, carry):
      idx = topk_ref[pl.ds(c * bk, bk)]
      ok = idx >= 0
      return update(carry, gkv_ref[jnp.maximum(idx, 0), :], ok)
    carry = jax.lax.fori_loop(0, n_chunks, global_chunk, carry)
  m, l, acc = carry
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse = m + jnp.log(l)
  lse_ref[...] = lse
  if scores:
    # global_probs of this head group: `_probs_kernel`'s sums from the same scores and lse.
    real = (pl.program_id(2) * hb + jax.lax.broadcasted_iota(jnp.int32, (hb,), 0)) < n_heads
    for c, (s, ok) in enumerate(scores):
      p = jnp.where(real[:, None] & ok[None, :], jnp.exp(s - lse[:, None]), 0.0)
      p_ref[0][pl.ds(c * bk, bk)] = jnp.sum(p, axis=0)


def _probs_kernel(q_ref, gkv_ref, topk_ref, lse_ref, p_ref, *, scale, bk, n_chunks, n_heads, hb):
  g = pl.program_id(2)
  q = q_ref[...]
  lse = lse_ref[...]
  real = (g * hb + jax.lax.broadcasted_iota(jnp.int32, (hb,), 0)) < n_heads

  def chunk(c, carry):
    idx = topk_ref[pl.ds(c * bk, bk)]
    ok = idx >= 0
    s = _dot(q, gkv_ref[jnp.maximum(idx, 0), :], _NT) * scale
    p = jnp.where(real[:, None] & ok[None, :], jnp.exp(s - lse[:, None]), 0.0)
    p_ref[pl.ds(c * bk, bk)] = jnp.sum(p, axis=0)
    return carry

  jax.lax.fori_loop(0, n_chunks, chunk, lse)


# --- wrappers --------------------------------------------------------------------------------------

class _Plan:
  """Static layout: padded heads Hp = G·Hb, window block wb in chunks of bkw, K padded to Kp = n·bk."""

  def __init__(self, H, D, K, window, block_h, block_k):
    self.hp = max(16, _next_pow2(H))
    self.hb = min(self.hp, _next_pow2(block_h or 16))
    self.g = self.hp // self.hb
    self.bk = block_k or (64 if D <= 256 else 32)
    self.wb = _next_pow2(window)
    self.bkw = min(self.bk, self.wb)
    self.n_chunks = -(-K // self.bk) if K else 0
    self.kp = self.n_chunks * self.bk


def _specs(plan, B, T, D, N, has_global):
  hb = plan.hb
  q_spec = pl.BlockSpec((None, None, hb, D), lambda b, t, g: (b, t, g, 0))
  kv_spec = pl.BlockSpec((None, T + plan.wb, D), lambda b, t, g: (b, 0, 0))
  seg_spec = pl.BlockSpec((None, T + plan.wb), lambda b, t, g: (b, 0))
  h_spec = pl.BlockSpec((None, None, hb), lambda b, t, g: (b, t, g))
  glob = []
  if has_global:
    glob = [pl.BlockSpec((None, N + 1, D), lambda b, t, g: (b, 0, 0)),
            pl.BlockSpec((None, None, plan.kp), lambda b, t, g: (b, t, 0))]
  return q_spec, kv_spec, seg_spec, h_spec, glob


def _call(kernel, *, grid, in_specs, out_specs, out_shape, interpret, num_warps, num_stages,
          name):
  # Through `jax.jit`: remat's partial evaluation stages a bare `pallas_call` into the recomputed
  # forward even when its named results are kept (`ops.sparse_attention.OUTPUT`); a jitted call
  # stays in the forward (as `topk_triton`'s select).
  return jax.jit(pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret, name=name))


def _prepare(q, kv, seg, sink, gkv, topk, plan):
  B, T, H, D = q.shape
  pad_h = plan.hp - H
  qp = jnp.pad(q, ((0, 0), (0, 0), (0, pad_h), (0, 0)))
  kvp = jnp.pad(kv, ((0, 0), (plan.wb, 0), (0, 0)))
  segp = jnp.pad(seg.astype(jnp.int32), ((0, 0), (plan.wb, 0)), constant_values=-1)
  sinkp = jnp.pad(sink.astype(_F32), (0, pad_h))
  glob = ()
  if gkv is not None:
    glob = (jnp.pad(gkv, ((0, 0), (0, 1), (0, 0))),                 # row N: the spare row
            jnp.pad(topk.astype(jnp.int32), ((0, 0), (0, 0), (0, plan.kp - topk.shape[-1])),
                    constant_values=-1))
  return qp, kvp, segp, sinkp, glob


def _forward(q, kv, seg, sink, gkv, topk, *, window, scale, block_h, block_k, interpret, num_warps,
             num_stages, with_probs: bool = False):
  """(o, lse, global_probs or None, plan); `with_probs`: the forward kernel also writes
  global_probs (the global branch only), from the scores it holds once lse is known."""
  B, T, H, D = q.shape
  has_global = gkv is not None
  with_probs = with_probs and has_global
  K = topk.shape[-1] if has_global else 0
  N = gkv.shape[1] if has_global else 0
  plan = _Plan(H, D, K, window, block_h, block_k)
  qp, kvp, segp, sinkp, glob = _prepare(q, kv, seg, sink, gkv, topk, plan)
  q_spec, kv_spec, seg_spec, h_spec, glob_specs = _specs(plan, B, T, D, N, has_global)
  kernel = functools.partial(_fwd_kernel, scale=scale, window=window, wb=plan.wb, bkw=plan.bkw,
                             bk=plan.bk, n_chunks=plan.n_chunks, has_global=has_global,
                             **(dict(n_heads=H, hb=plan.hb) if with_probs else {}))
  out_specs = [q_spec, h_spec]
  out_shape = [jax.ShapeDtypeStruct(qp.shape, q.dtype),
               jax.ShapeDtypeStruct((B, T, plan.hp), _F32)]
  if with_probs:
    out_specs.append(pl.BlockSpec((None, None, None, plan.kp), lambda b, t, g: (b, t, g, 0)))
    out_shape.append(jax.ShapeDtypeStruct((B, T, plan.g, plan.kp), _F32))
  outs = _call(
      kernel, grid=(B, T, plan.g),
      in_specs=[q_spec, kv_spec, seg_spec, pl.BlockSpec((plan.hb,), lambda b, t, g: (g,))]
      + glob_specs,
      out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, num_warps=num_warps, num_stages=num_stages,
      name="sparse_attention_fwd")(qp, kvp, segp, sinkp, *glob)
  probs = jnp.sum(outs[2], axis=2)[..., :K] if with_probs else None
  return outs[0][:, :, :H], outs[1], probs, plan


def _global_probs(q, gkv, topk, lse, *, scale, block_h, block_k, interpret, num_warps, num_stages):
  B, T, H, D = q.shape
  K = topk.shape[-1]
  N = gkv.shape[1]
  plan = _Plan(H, D, K, 1, block_h, block_k)
  qp = jnp.pad(q, ((0, 0), (0, 0), (0, plan.hp - H), (0, 0)))
  gkvp = jnp.pad(gkv, ((0, 0), (0, 1), (0, 0)))
  topkp = jnp.pad(topk.astype(jnp.int32), ((0, 0), (0, 0), (0, plan.kp - K)), constant_values=-1)
  q_spec, _, _, h_spec, glob_specs = _specs(plan, B, T, D, N, True)
  kernel = functools.partial(_probs_kernel, scale=scale, bk=plan.bk, n_chunks=plan.n_chunks,
                             n_heads=H, hb=plan.hb)
  p = _call(
      kernel, grid=(B, T, plan.g), in_specs=[q_spec, *glob_specs, h_spec],
      out_specs=pl.BlockSpec((None, None, None, plan.kp), lambda b, t, g: (b, t, g, 0)),
      out_shape=jax.ShapeDtypeStruct((B, T, plan.g, plan.kp), _F32),
      interpret=interpret, num_warps=num_warps, num_stages=num_stages,
      name="sparse_attention_probs")(qp, gkvp, topkp, lse)
  return jnp.sum(p, axis=2)[..., :K]
