"""Sparse attention over the SWA window ∪ the top-k compressed entries, with sink (docs/design.md §4.3, §14).

The kernel of the op `sparse_attention`: restates `pallas_kernels.ops.sparse_attention.attend`
(tests compare the two) as Pallas kernels that
never build the [B, T, K, D] gather nor score all N entries. For query t, head h:

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
  `_bwd`    recomputes p from lse; dq per program; dkv of window and selected entries scattered
            with float32 atomic adds (rows shared by many queries); dsink in XLA from lse and
            Δ = Σ_d dO·O. Selected slots of one row must be distinct, as `lax.top_k` makes them
            (the same assumption as `attend`'s "gather" form; "masked" counts a repeat once).

Backend: Triton via `pl.pallas_call` with explicit `plt.CompilerParams`; `interpret=True` on CPU.
Shapes the kernel cannot take are named by `unsupported_reason` (the dispatcher's rule).
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
                has_global):
  if has_global:
    gkv_ref, topk_ref, o_ref, lse_ref = rest
  else:
    o_ref, lse_ref = rest
  t = pl.program_id(1)
  q = q_ref[...]                                                    # [Hb, D]
  seg_t = seg_ref[pl.ds(t + wb, 1)]                                 # [1]
  sink = sink_ref[...]                                              # [Hb] f32

  def update(carry, k, ok):
    m, l, acc = carry
    s = _dot(q, k, _NT) * scale                                     # [Hb, bk]
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
  if has_global:
    def global_chunk(c, carry):
      idx = topk_ref[pl.ds(c * bk, bk)]
      ok = idx >= 0
      return update(carry, gkv_ref[jnp.maximum(idx, 0), :], ok)
    carry = jax.lax.fori_loop(0, n_chunks, global_chunk, carry)
  m, l, acc = carry
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


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


def _bwd_kernel(q_ref, do_ref, lse_ref, delta_ref, kv_ref, seg_ref, *rest, scale, window, wb, bkw,
                bk, n_chunks, trash_row, has_global):
  from jax.experimental.pallas import triton as plt
  if has_global:
    gkv_ref, topk_ref, _, _, dq_ref, dkv_ref, dg_ref = rest
  else:
    _, dq_ref, dkv_ref = rest
  t = pl.program_id(1)
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  seg_t = seg_ref[pl.ds(t + wb, 1)]

  def grads(dq, k, ok):
    s = _dot(q, k, _NT) * scale
    p = jnp.where(ok[None, :], jnp.exp(s - lse[:, None]), 0.0)     # [Hb, bk]
    dp = _dot(do, k, _NT)
    ds = p * (dp - delta[:, None])
    dq = dq + _dot(ds.astype(k.dtype), k, (((1,), (0,)), ((), ()))) * scale
    dk = (_dot(ds.astype(q.dtype), q, _TN) * scale
          + _dot(p.astype(do.dtype), do, _TN))                      # [bk, D]: dK + dV (K = V)
    return dq, dk

  D = q.shape[-1]
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, D), 1)

  def window_chunk(c, dq):
    start, ok = _window_rows(t, c, wb, bkw, window, seg_ref, seg_t)
    dq, dk = grads(dq, kv_ref[pl.ds(start, bkw), :], ok)
    rows = start + jax.lax.broadcasted_iota(jnp.int32, (bkw, 1), 0)
    plt.atomic_add(dkv_ref, (rows, cols), dk)
    return dq

  dq = jax.lax.fori_loop(0, wb // bkw, window_chunk, jnp.zeros(q.shape, _F32))
  if has_global:
    def global_chunk(c, dq):
      idx = topk_ref[pl.ds(c * bk, bk)]
      ok = idx >= 0
      dq, dk = grads(dq, gkv_ref[jnp.maximum(idx, 0), :], ok)
      rows = jnp.where(ok, idx, trash_row)[:, None]                 # empty slots add 0 to a spare row
      plt.atomic_add(dg_ref, (rows, cols), dk)
      return dq
    dq = jax.lax.fori_loop(0, n_chunks, global_chunk, dq)
  dq_ref[...] = dq.astype(dq_ref.dtype)


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
          name, aliases=None):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases or {},
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret, name=name)


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
             num_stages):
  B, T, H, D = q.shape
  has_global = gkv is not None
  K = topk.shape[-1] if has_global else 0
  N = gkv.shape[1] if has_global else 0
  plan = _Plan(H, D, K, window, block_h, block_k)
  qp, kvp, segp, sinkp, glob = _prepare(q, kv, seg, sink, gkv, topk, plan)
  q_spec, kv_spec, seg_spec, h_spec, glob_specs = _specs(plan, B, T, D, N, has_global)
  kernel = functools.partial(_fwd_kernel, scale=scale, window=window, wb=plan.wb, bkw=plan.bkw,
                             bk=plan.bk, n_chunks=plan.n_chunks, has_global=has_global)
  o, lse = _call(
      kernel, grid=(B, T, plan.g),
      in_specs=[q_spec, kv_spec, seg_spec, pl.BlockSpec((plan.hb,), lambda b, t, g: (g,))]
      + glob_specs,
      out_specs=[q_spec, h_spec],
      out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, T, plan.hp), _F32)],
      interpret=interpret, num_warps=num_warps, num_stages=num_stages,
      name="sparse_attention_fwd")(qp, kvp, segp, sinkp, *glob)
  return o[:, :, :H], lse, plan


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


def _backward(q, kv, seg, sink, gkv, topk, o, lse, do, *, window, scale, block_h, block_k, interpret,
              num_warps, num_stages):
  B, T, H, D = q.shape
  has_global = gkv is not None
  K = topk.shape[-1] if has_global else 0
  N = gkv.shape[1] if has_global else 0
  plan = _Plan(H, D, K, window, block_h, block_k)
  qp, kvp, segp, _, glob = _prepare(q, kv, seg, sink, gkv, topk, plan)
  dop = jnp.pad(do.astype(q.dtype), ((0, 0), (0, 0), (0, plan.hp - H), (0, 0)))
  delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1)       # [B, T, H]
  deltap = jnp.pad(delta, ((0, 0), (0, 0), (0, plan.hp - H)))
  q_spec, kv_spec, seg_spec, h_spec, glob_specs = _specs(plan, B, T, D, N, has_global)
  acc_kv = jax.ShapeDtypeStruct((B, T + plan.wb, D), _F32)
  in_specs = [q_spec, q_spec, h_spec, h_spec, kv_spec, seg_spec] + glob_specs
  args = [qp, dop, lse, deltap, kvp, segp, *glob]
  out_specs = [q_spec, pl.BlockSpec((None, T + plan.wb, D), lambda b, t, g: (b, 0, 0))]
  out_shape = [jax.ShapeDtypeStruct(qp.shape, q.dtype), acc_kv]
  # The dkv accumulators come in as zeros and are updated in place (aliased to the outputs).
  in_specs.append(out_specs[1])
  args.append(jnp.zeros(acc_kv.shape, _F32))
  aliases = {len(args) - 1: 1}
  if has_global:
    g_spec = pl.BlockSpec((None, N + 1, D), lambda b, t, g: (b, 0, 0))
    in_specs.append(g_spec)
    args.append(jnp.zeros((B, N + 1, D), _F32))
    aliases[len(args) - 1] = 2
    out_specs.append(g_spec)
    out_shape.append(jax.ShapeDtypeStruct((B, N + 1, D), _F32))
  kernel = functools.partial(_bwd_kernel, scale=scale, window=window, wb=plan.wb, bkw=plan.bkw,
                             bk=plan.bk, n_chunks=plan.n_chunks, trash_row=N, has_global=has_global)
  outs = _call(kernel, grid=(B, T, plan.g), in_specs=in_specs, out_specs=out_specs,
               out_shape=out_shape, interpret=interpret, num_warps=num_warps,
               num_stages=num_stages, name="sparse_attention_bwd", aliases=aliases)(*args)
  dq = outs[0][:, :, :H]
  dkv = outs[1][:, plan.wb:].astype(kv.dtype)
  dg = outs[2][:, :N].astype(gkv.dtype) if has_global else None
  # dsink_h = −Σ_t p_sink(t, h) · Δ(t, h), p_sink = exp(sink_h − lse).
  p_sink = jnp.exp(sink.astype(_F32)[None, None, :] - lse[..., :H])
  dsink = -jnp.sum(p_sink * delta, axis=(0, 1)).astype(sink.dtype)
  return dq, dkv, dsink, dg


_STATIC = ("window", "scale", "block_h", "block_k", "interpret", "num_warps", "num_stages")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attn(q, kv, seg, sink, gkv, topk, static):
  return _attn_fwd(q, kv, seg, sink, gkv, topk, static)[0]


def _attn_fwd(q, kv, seg, sink, gkv, topk, static):
  kw = {k: v for k, v in static if k != "block_k_bwd"}
  o, lse, _ = _forward(q, kv, seg, sink, gkv, topk, **kw)
  return (o, lse), (q, kv, seg, sink, gkv, topk, o, lse)


def _attn_bwd(static, res, cts):
  q, kv, seg, sink, gkv, topk, o, lse = res
  do, _ = cts   # lse is used only under stop_gradient (global_probs): its cotangent is zero
  static = dict(static)
  static["block_k"] = static.pop("block_k_bwd")
  dq, dkv, dsink, dg = _backward(q, kv, seg, sink, gkv, topk, o, lse, do, **static)
  return dq, dkv, None, dsink, dg, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def sparse_attend(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT, sink_H, global_kv_BxNxD=None,
                  topk_BxTxK=None, *, window: int, scale: float, impl: str | None = None,
                  query_chunk: int | None = None, interpret: bool | None = None,
                  block_h: int | None = None, block_k: int | None = None,
                  block_k_bwd: int | None = 32, num_warps: int = 4, num_stages: int = 2):
  """The op's kernel (the arguments and results of `attend`): (o, global_probs).

  `impl` and `query_chunk` choose the reference's XLA form and chunking; the kernel has neither
  intermediate, so it takes them and ignores them.
  `global_probs_BxTxK` carries no gradient (the model stops it; `attend`'s would flow to q and
  the entries). `interpret=None` interprets on CPU and compiles (Triton) on GPU.
  Key chunks: `block_k` rows in the forward (None: 64 for D ≤ 256, else 32), `block_k_bwd` in the
  backward. On the H200 at 1 × 32K, H 16, D 256 (benchmarks/RESULTS.md), 64 gave the faster
  forward (3.9 vs 4.8 ms) and 32 the faster forward + backward (34 vs 55 ms).
  """
  del impl, query_chunk
  if (global_kv_BxNxD is None) != (topk_BxTxK is None):
    raise ValueError("global_kv_BxNxD and topk_BxTxK must be given together")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  static = (("window", int(window)), ("scale", float(scale)), ("block_h", block_h),
            ("block_k", block_k), ("block_k_bwd", block_k_bwd), ("interpret", bool(interpret)),
            ("num_warps", num_warps),
            ("num_stages", num_stages))
  o, lse = _attn(q_BxTxHxD, swa_kv_BxTxD, segment_ids_BxT, sink_H, global_kv_BxNxD, topk_BxTxK,
                 static)
  if global_kv_BxNxD is None:
    return o, None
  sg = jax.lax.stop_gradient
  probs = _global_probs(sg(q_BxTxHxD), sg(global_kv_BxNxD), topk_BxTxK, sg(lse), scale=scale,
                        block_h=block_h, block_k=block_k, interpret=bool(interpret),
                        num_warps=num_warps, num_stages=num_stages)
  return o, probs

