"""CSA2 Pallas kernels vs the XLA forms, one device call (issues 13, 26; docs/design.md §4.3, §5.4).

  PYTHONUNBUFFERED=1 python benchmarks/csa2_kernels_gpu.py            # H200, writes $OUT/csa2.json
  JAX_PLATFORMS=cpu python benchmarks/csa2_kernels_gpu.py --smoke      # CPU: tiny, interpreted

1. Correctness on the GPU (bf16 inputs, against float32 references on the same inputs):
   each attention kernel's o, global_probs and gradients (q, kv, entries, sink) vs
   `attend_reference`, and whether two backward runs are bitwise equal; indexer scores vs
   `indexer_scores` + `entry_visible`, and the kernel's top-k sets vs XLA's.
2. Sparse attention at s3's shapes (H 16, D 128, window 128, top-256 distinct causal entries,
   ratios 2 and 1, sink; loss Σ o², global_probs computed and detached): the XLA forms ("masked",
   query-chunked where its [rows, H, N] scores would not fit, and "gather") and the op's kernel
   with its deterministic backward (`pallas_kernels.csa2_attention`)
   at T = 4K (B 4), 16K, 32K, 64K (B 1), forward and forward + backward, the kernel both making
   its slot plan in the call ("pallas csa2", a selecting layer) and handed it ("csa2 planned", a
   Reuse layer; the plan's own time is the "slot plan" row), and the ratios of each over the best
   XLA form and over "masked", flagged where any XLA form is faster. Useful FLOPs: 4·B·T·H·D·(W + K) forward (QK + PV at
   the keys attended), ×3 with the backward. At 4K m1 also: the kernel's variants and tiles
   ("4k-m1-variants", "-tiles", "-launch", one change from the defaults each), the window alone
   ("4k-swa", s3's SWA layers) and forward + backward under layer remat ("4k-m1-remat": the
   model's policy, which keeps the forward's results, against nothing kept).
3. Indexer (s3: H_I 16, D_I 128, top-256, m 1, one document, 4 × 4096): the Triton kernel's
   scores alone, scores + selection (the forward `score_and_select`, radix select), and forward +
   backward of Σ_n r_n · (scores_at_topk summed at entry n), against the op's reference (XLA
   scores, `lax.top_k`, query_chunk 512) and its XLA kernel (the same scores, the radix select,
   `pallas_kernels.topk_select.score_and_select`); the speedup of each forward over the
   reference's. FLOPs: 2·B·T·N·H_I·D_I (all pairs; the causal half is the useful part, which the
   Triton kernel skips block-wise). Then `scores_at` alone (the selected entries' scores and the
   KL loss's gradient path), its Triton kernels against its XLA form, fwd and fwd+bwd.
4. Selection alone (`--cases topk-4k`): `lax.top_k` against the radix threshold select of
   `pallas_kernels.topk_select` over [4, 4096, 4096] causal scores, and whether the sets agree.
Rates are against the 790 TFLOP/s bf16 matmul ceiling measured on this H200. Median of `--reps`.
Imports only jax, numpy, dsv41_jax and pallas_kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.common import elapsed, header, time_calls
from dsv41_jax.layers import indexer as ix
from pallas_kernels.ops import sparse_attention as sa
from dsv41_jax.layers.types import CompressedKV, entry_visible
from pallas_kernels import indexer as kx
from pallas_kernels import csa2_attention as ca
from pallas_kernels import topk_select as tsel
from pallas_kernels import topk_triton as ttk
from pallas_kernels.ops import indexer as ops_indexer

CEILING = 790e12
ROWS: list[dict] = []


def out_path():
  return os.path.join(os.environ.get("OUT", "/tmp"), "csa2.json")


def emit(**row):
  ROWS.append(row)
  print("ROW", json.dumps(row), flush=True)
  with open(out_path(), "w") as f:
    json.dump(ROWS, f, indent=1)


def guarded(label, f):
  if elapsed() > ARGS.deadline:
    emit(kind="skipped", label=label, why="deadline")
    return None
  try:
    return f()
  except Exception as e:  # a failure is a result too; keep going
    emit(kind="error", label=label, error=f"{type(e).__name__}: {str(e)[:400]}")
    return None


def rel(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


# --- sparse attention ---------------------------------------------------------------------------

def attn_inputs(B, T, H, D, m, K, dtype, seed=0):
  N = T // m
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(k[0], (B, T, H, D), dtype)
  kv = jax.random.normal(k[1], (B, T, D), dtype)
  g = jax.random.normal(k[2], (B, N, D), dtype)
  sink = 0.5 * jax.random.normal(k[4], (H,), jnp.float32)
  seg = jnp.ones((B, T), jnp.int32)
  rows = min(T, 2048)   # the random scores a chunk of rows at a time: [B, T, N] would not fit at 64K

  def chunk(i):
    t = i * rows + jnp.arange(rows)
    vis = (jnp.arange(N)[None, :] + 1) * m <= t[:, None] + 1
    score = jnp.where(vis, jax.random.normal(jax.random.fold_in(k[3], i), (B, rows, N)), -jnp.inf)
    val, idx = jax.lax.top_k(score, K)
    return jnp.where(jnp.isfinite(val), idx, -1).astype(jnp.int32)

  topk = jax.lax.map(chunk, jnp.arange(T // rows))                  # [T/rows, B, rows, K]
  topk = jnp.moveaxis(topk, 0, 1).reshape(B, T, K)
  return q, kv, g, sink, seg, topk


def attn_fns(fn, W, D, global_branch=True):
  """Jitted forward and value-and-grad of `fn` (the op's signature); both take the kernel's slot
  plan as a last argument where one is given (`csa2 planned`). Without `global_branch`, the
  window alone (s3's two SWA layers): g and topk are not passed."""
  def fwd(q, kv, g, sink, seg, topk, *plan):
    kw = dict(plan=plan[0]) if plan else {}
    if not global_branch:
      g = topk = None
    return fn(q, kv, seg, sink, window=W, scale=D ** -0.5, global_kv_BxNxD=g, topk_BxTxK=topk,
              **kw)

  def loss(q, kv, g, sink, seg, topk, *plan):
    o, p = fwd(q, kv, g, sink, seg, topk, *plan)
    return jnp.sum(o.astype(jnp.float32) ** 2), jax.lax.stop_gradient(p)

  return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def slot_plan_fn(W, D):
  """The kernel's slot plan of the benchmark's arguments, jitted (what a selecting layer makes
  once for itself and its Reuse layers)."""
  return jax.jit(lambda q, kv, g, sink, seg, topk: ca.slot_plan(q, kv, seg, sink, g, topk,
                                                                window=W, scale=D ** -0.5))


def attn_check(interp):
  """bf16 kernels vs the float32 reference on the same inputs; the new kernel's determinism."""
  B, T, H, D, W, m, K = (1, 2048, 16, 128, 128, 2, 256) if not ARGS.smoke else (1, 48, 4, 32, 8, 2, 8)
  x = attn_inputs(B, T, H, D, m, K, jnp.bfloat16, seed=1)
  x32 = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in x)
  rf, rg = attn_fns(sa.attend_reference, W, D)
  ro, rp = rf(*x32)
  (_, _), gr = rg(*x32)
  plan = (slot_plan_fn(W, D)(*x),)
  for name, fn in {"pallas csa2": ca.sparse_attend,
                   "csa2 f32c": partial(ca.sparse_attend, contrib_dtype=jnp.float32)}.items():
    kf, kg = attn_fns(partial(fn, interpret=interp), W, D)
    o, p = kf(*x)
    (_, _), gk = kg(*x)
    (_, _), gk2 = kg(*x)
    bits = lambda g: all(bool(jnp.all(a == b)) for a, b in zip(gk, g))
    row = dict(bwd_bitwise_repeatable=bits(gk2))
    if name == "pallas csa2":    # the plan made apart gives the same bits
      row["planned_bitwise_equal"] = bits(kg(*x, *plan)[1])
    emit(kind="check", what=f"{name} bf16 vs f32 reference", shape=f"B{B} T{T} H{H} D{D} K{K}",
         rel_o=rel(o, ro), rel_probs=rel(p, rp), rel_dq=rel(gk[0], gr[0]),
         rel_dkv=rel(gk[1], gr[1]), rel_dglobal=rel(gk[2], gr[2]), rel_dsink=rel(gk[3], gr[3]),
         **row)


# The op's kernel (pallas_kernels/csa2_attention.py; the issue-13 kernel with float32 atomics in
# its backward is retired), timed twice: making its slot plan inside the call ("pallas csa2", a
# layer alone) and handed the plan made apart ("csa2 planned": a Reuse layer of the selection; the
# plan's own time is a row of its own, "slot plan").
KERNELS = {"pallas csa2": ca.sparse_attend, "csa2 planned": ca.sparse_attend}
# Variants of the deterministic kernel, timed at 4K m1 only. The defaults: global_probs written
# by the forward kernel, the flat slot sort with count bounds, block_k 64 (forward), block_k_bwd
# 64, block_kw 64, 4 warps and 2 stages in every kernel. ("4k-m1-variants": the ways of making
# global_probs and the slot order; the bfloat16 contributions, entry sums at 16-64 rows and 1-4
# warps were measured before: RESULTS.md, issue 26.)
VARIANTS = {"csa2 probs apart": partial(ca.sparse_attend, fused_probs=False),
            "csa2 rows sort": partial(ca.sparse_attend, sort="rows"),
            "csa2 search": partial(ca.sparse_attend, bounds="search")}
# Tiles and launch settings at s3's shapes, one change from the defaults each: "4k-m1-tiles" the
# first four (forward and dq slot blocks), "4k-m1-launch" the rest (band, warps, stages).
TILES = {"csa2 fwd bk32": partial(ca.sparse_attend, block_k=32),
         "csa2 fwd bk128": partial(ca.sparse_attend, block_k=128),
         "csa2 dq bk32": partial(ca.sparse_attend, block_k_bwd=32),
         "csa2 dq bk128": partial(ca.sparse_attend, block_k_bwd=128),
         "csa2 band bkw32": partial(ca.sparse_attend, block_kw=32),
         "csa2 band bkw128": partial(ca.sparse_attend, block_kw=128),
         "csa2 warps2": partial(ca.sparse_attend, num_warps=2),
         "csa2 warps8": partial(ca.sparse_attend, num_warps=8),
         "csa2 stages1": partial(ca.sparse_attend, num_stages=1),
         "csa2 stages3": partial(ca.sparse_attend, num_stages=3),
         "csa2 stages4": partial(ca.sparse_attend, num_stages=4)}


def attn_bench(B, T, m, interp, reps, xla_impls=(("masked", None),), kernels=tuple(KERNELS), H=16,
               D=128, W=128, K=256, global_branch=True):
  """Forward and forward + backward of every form at one shape; returns {(impl, mode): s}.
  `global_branch` False: the window alone (no entries, no top-k)."""
  x = attn_inputs(B, T, H, D, m, K, jnp.bfloat16)
  fl = 4.0 * B * T * H * D * (W + (K if global_branch else 0))
  shape = (f"{B}x{T} m{m} H{H} D{D} N{T // m} K{K}" if global_branch
           else f"{B}x{T} window only H{H} D{D} W{W}")
  res = {}
  forms = [(f"xla {i}" + (f" qc{c}" if c else ""), partial(sa.attend, impl=i, query_chunk=c))
           for i, c in xla_impls]
  forms += [(k, partial({**KERNELS, **VARIANTS, **TILES}[k], interpret=interp)) for k in kernels]
  plan = ()
  if "csa2 planned" in kernels and global_branch:
    make = slot_plan_fn(W, D)
    r = guarded(f"attn {shape} slot plan", lambda: time_calls(make, *x, reps=reps))
    if r:
      emit(kind="attn", shape=shape, impl="slot plan", mode="once per selection",
           ms=1e3 * r[0], first_s=r[1], tflops=0.0, of_ceiling=0.0)
      plan = (make(*x),)
  for name, fn in forms:
    if name == "csa2 planned" and not plan:
      continue
    args = x + plan if name == "csa2 planned" else x
    fwd, grad = attn_fns(fn, W, D, global_branch)
    for mode, f, mult in (("fwd", fwd, 1), ("fwd+bwd", grad, 3)):
      r = guarded(f"attn {shape} {name} {mode}", lambda: time_calls(f, *args, reps=reps))
      if r:
        res[(name, mode)] = r[0]
        emit(kind="attn", shape=shape, impl=name, mode=mode, ms=1e3 * r[0], first_s=r[1],
             tflops=mult * fl / r[0] / 1e12, of_ceiling=mult * fl / r[0] / CEILING)
  for mode in ("fwd", "fwd+bwd"):
    xla = {n: v for (n, md), v in res.items() if md == mode and n.startswith("xla")}
    for k in ("pallas csa2", "csa2 planned"):
      if xla and (k, mode) in res:
        emit(kind="ratio", shape=shape, mode=mode, kernel=k,
             over_best_xla=min(xla.values()) / res[(k, mode)],
             over_masked=(min(v for n, v in xla.items() if "masked" in n) / res[(k, mode)]
                          if any("masked" in n for n in xla) else None),
             slower_than_an_xla_form=any(v < res[(k, mode)] for v in xla.values()))
  return res


def attn_remat(B, T, m, interp, reps, H=16, D=128, W=128, K=256):
  """Forward + backward of the planned kernel under layer remat (`jax.checkpoint`), as the model
  runs it: the model's policy (keeps `ops.sparse_attention.OUTPUT`: one forward kernel) against
  nothing kept (the forward kernel again in the backward)."""
  from dsv41_jax.model import remat_policy
  x = attn_inputs(B, T, H, D, m, K, jnp.bfloat16)
  shape = f"{B}x{T} m{m} H{H} D{D} N{T // m} K{K}"
  plan = slot_plan_fn(W, D)(*x)

  def loss(q, kv, g, sink, seg, topk, plan):
    o, p = ca.sparse_attend(q, kv, seg, sink, g, topk, window=W, scale=D ** -0.5, plan=plan,
                            interpret=interp)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(jax.lax.stop_gradient(p)))

  for name, policy in (("remat keeps output", remat_policy),
                       ("remat recomputes", jax.checkpoint_policies.nothing_saveable)):
    f = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2, 3)))
    r = guarded(f"attn {shape} {name}", lambda: time_calls(f, *x, plan, reps=reps))
    if r:
      fl = 3 * 4.0 * B * T * H * D * (W + K)
      emit(kind="attn", shape=shape, impl=f"csa2 planned, {name}", mode="fwd+bwd",
           ms=1e3 * r[0], first_s=r[1], tflops=fl / r[0] / 1e12, of_ceiling=fl / r[0] / CEILING)


def attn_breakdown(B, T, m, interp, reps, H=16, D=128, W=128, K=256):
  """The deterministic backward's stages timed alone (each jitted apart) at one shape."""
  q, kv, g, sink, seg, topk = attn_inputs(B, T, H, D, m, K, jnp.bfloat16)
  shape = f"{B}x{T} m{m} H{H} D{D} N{T // m} K{K}"
  fw = dict(window=W, scale=D ** -0.5, block_h=None, block_k=None, interpret=interp,
            num_warps=4, num_stages=2)
  o, lse, _, plan = ca._sa._forward(q, kv, seg, sink, g, topk, **fw)
  do = jax.random.normal(jax.random.PRNGKey(7), o.shape, o.dtype)
  bw = dict(fw, block_k=64, block_kw=64, block_e=16, sum_warps=4, bounds="count", sort="flat",
            max_contrib_elems=1 << 29, contrib_dtype=jnp.bfloat16)
  row = lambda name, t: emit(kind="stage", shape=shape, stage=name, ms=1e3 * t[0])
  slots = slot_plan_fn(W, D)(q, kv, g, sink, seg, topk)
  for name, kw, extra in (("backward", {}, ()),
                          ("backward f32 contrib", dict(contrib_dtype=jnp.float32), ()),
                          ("backward, slot plan given", {}, (slots,))):
    f = jax.jit(lambda *a, kw=kw: ca._backward(*a, **{**bw, **kw}))
    t = guarded(f"stage {name}", lambda: time_calls(f, q, kv, seg, sink, g, topk, o, lse, do,
                                                     *extra, reps=reps))
    if t:
      row(name, t)
  hp = plan.hp
  pad = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, hp - H)] + [(0, 0)] * (a.ndim - 3))
  f = jax.jit(lambda qp, dop, lse, dl: ca._window_dkv(
      qp, dop, lse, dl, seg, kv, window=W, scale=D ** -0.5, hp=hp, bkw=64, interpret=interp,
      num_warps=4, num_stages=2))
  dl = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)
  t = guarded("stage window", lambda: time_calls(f, pad(q), pad(do), lse, pad(dl), reps=reps))
  if t:
    row("window dK/dV band kernel", t)
  ids = jnp.pad(topk, ((0, 0), (0, 0), (0, plan.kp - K)), constant_values=-1).reshape(B, -1)
  sort_only = jax.jit(lambda i: jax.lax.sort((i, jax.lax.broadcasted_iota(jnp.int32, i.shape, 1)),
                                                dimension=1, num_keys=1))
  t = guarded("stage sort", lambda: time_calls(sort_only, ids, reps=reps))
  if t:
    row("slot sort alone", t)
  for bounds, sort in (("count", "rows"), ("search", "rows"), ("count", "flat"),
                       ("search", "flat")):
    f = jax.jit(lambda i, b_=bounds, s_=sort: ca._slot_order(i, T // m, b_, s_))
    t = guarded("stage sort", lambda: time_calls(f, ids, reps=reps))
    if t:
      row(f"slot sort {sort} + bounds {bounds}", t)
  order, lo, hi = f(ids)
  c = jax.random.normal(jax.random.PRNGKey(8), (B, ids.shape[1], D), jnp.bfloat16)
  for be, nw in ((16, 4), (32, 1), (32, 2), (64, 2), (16, 1)):
    f2 = jax.jit(lambda c, o_, l, h, be=be, nw=nw: ca._entry_sums(
        c, o_, l, h, be=be, interpret=interp, num_warps=nw, num_stages=2))
    t = guarded("stage sums", lambda: time_calls(f2, c, order, lo, hi, reps=reps))
    if t:
      row(f"entry sums bf16 be{be} w{nw}", t)


# --- indexer ------------------------------------------------------------------------------------

def idx_inputs(T, H, I, K, dtype, seed=0, B=1):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(k[0], (B, T, H, I), dtype)
  w = jax.random.normal(k[1], (B, T, H), jnp.float32) * H ** -0.5
  idx_k = jax.random.normal(k[2], (B, T, I), dtype)
  r = jax.random.normal(k[3], (B, T, min(K, T)), jnp.float32)
  seg = jnp.ones((B, T), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  return q, w, idx_k, r, seg, pos


def by_entry(topk_BxTxK, picked_BxTxK, n_entries):
  """The selected scores summed per entry [B, N]: a loss over it does not depend on slot order."""
  B = topk_BxTxK.shape[0]
  return jnp.zeros((B, n_entries), jnp.float32).at[
      jnp.arange(B)[:, None, None], jnp.maximum(topk_BxTxK, 0)].add(
          jnp.where(topk_BxTxK >= 0, picked_BxTxK, 0.0))


def idx_check(interp):
  T, H, I, K = (4096, 32, 128, 512) if not ARGS.smoke else (64, 4, 32, 8)
  q, w, idx_k, r, seg, pos = idx_inputs(T, H, I, K, jnp.bfloat16, seed=2)
  kv = CompressedKV(None, idx_k, seg, pos, pos)
  s = jax.jit(partial(kx.masked_scores, interpret=interp))(
      q, w, idx_k, seg, pos, seg, jnp.arange(T))
  ref = ix.indexer_scores(q, idx_k, w)
  vis = entry_visible(kv, seg)
  same_mask = bool(jnp.all(jnp.isfinite(s) == vis))
  err = float(jnp.max(jnp.where(vis, jnp.abs(s - ref), 0.0)) / jnp.max(jnp.abs(ref)))
  tk, _ = jax.jit(partial(kx.score_and_select, k=K, interpret=interp))(q, w, idx_k, seg, pos, seg)
  rt, _, _ = jax.jit(partial(ix.score_and_select, k=K, query_chunk=512))(q, w, kv, seg)
  same = jnp.all(jnp.sort(tk, -1) == jnp.sort(rt, -1), axis=-1)
  # The KL path's gradient (through the K selected entries, keys summed per entry) against the
  # reference's (through all N scores), bf16 inputs both.
  rn = jax.random.normal(jax.random.PRNGKey(5), (1, T), jnp.float32)
  loss = lambda sel: jax.jit(jax.grad(lambda q, w, k: jnp.sum(by_entry(*sel(q, w, k), T) * rn),
                                      argnums=(0, 1, 2)))
  gk = loss(lambda q, w, k: kx.score_and_select(q, w, k, seg, pos, seg, k=K,
                                                interpret=interp))(q, w, idx_k)
  gr = loss(lambda q, w, k: ix.score_and_select(q, w, CompressedKV(None, k, seg, pos, pos), seg,
                                                k=K, query_chunk=512)[:2])(q, w, idx_k)
  emit(kind="check", what="indexer bf16 kernel vs XLA", shape=f"T{T} H{H} I{I} K{K}",
       mask_equal=same_mask, max_score_err_rel_to_max=err,
       rows_same_topk_set=float(jnp.mean(same)), rel_dq=rel(gk[0], gr[0]),
       rel_dw=rel(gk[1], gr[1]), rel_dk=rel(gk[2], gr[2]))


def idx_bench(T, interp, reps, xla=True, H=32, I=128, K=512, variants=((64, 128, 4, 512),), B=1):
  q, w, idx_k, r, seg, pos = idx_inputs(T, H, I, K, jnp.bfloat16, B=B)
  fl = 2.0 * B * T * T * H * I
  shape = f"{B}x{T} H{H} I{I} K{K} m1"
  row = lambda **kw: emit(kind="indexer", shape=shape, **kw)

  def rate(impl, mode, t):
    row(impl=impl, mode=mode, ms=1e3 * t[0], first_s=t[1], tflops=fl / t[0] / 1e12,
        of_ceiling=fl / t[0] / CEILING)

  for bt, bn, nw, *chunk in variants:    # (block_t, block_n, warps[, block_chunk])
    name = f"pallas t{bt} n{bn} w{nw}" + (f" c{chunk[0]}" if chunk else "")
    f = jax.jit(partial(kx.masked_scores, block_t=bt, block_n=bn, num_warps=nw,
                        block_chunk=chunk[0] if chunk else None, interpret=interp))
    t = guarded(f"idx {shape} {name} scores",
                lambda: time_calls(f, q, w, idx_k, seg, pos, seg, jnp.arange(T), reps=reps))
    if t:
      rate(name, "scores only", t)
  N = idx_k.shape[1]
  r = jax.random.normal(jax.random.PRNGKey(9), (B, N), jnp.float32)   # a weight per entry
  times = {}
  bt, bn, nw = variants[0][:3]
  # The selections (XLA radix passes, one program a row, the same stopping early) after the first
  # variant's scores; then the early-exit select after each other variant's.
  forms = [(select, variants[0]) for select in ("radix", "triton", "triton_early")] + [
      ("triton_early", v) for v in variants[1:]]
  for select, (bt, bn, nw, *chunk) in forms:
    name = (f"pallas t{bt} n{bn} w{nw}" + (f" c{chunk[0]}" if chunk else "")
            + {"radix": "", "triton": " + triton select",
               "triton_early": " + triton early exit"}[select])
    sel = partial(kx.score_and_select, k=K, interpret=interp, block_t=bt, block_n=bn,
                  block_chunk=chunk[0] if chunk else None, num_warps=nw, select=select)
    f = jax.jit(lambda q, w, k, sel=sel: sel(q, w, k, seg, pos, seg))
    g = jax.jit(jax.grad(lambda q, w, k, sel=sel: jnp.sum(
        by_entry(*sel(q, w, k, seg, pos, seg), N) * r), argnums=(0, 1, 2)))
    for mode, fn in (("fwd (scores+top-k)", f), ("fwd+bwd", g)):
      t = guarded(f"idx {shape} {name} {mode}", lambda: time_calls(fn, q, w, idx_k, reps=reps))
      if t:
        rate(name, mode, t)
        times[(name, mode)] = t[0]
  if xla:
    # The op's reference (XLA scores, lax.top_k) and its XLA kernel (the same scores, the radix
    # select), both query_chunk 512 as the model runs them; r·scores_at_topk summed by entry, so
    # the slot order is free.
    for name, op in (("xla chunk512", ops_indexer.score_and_select),
                     ("xla + radix select", tsel.score_and_select)):
      sel = lambda q, w, k, op=op: op(q, w, k, seg, pos, seg, None, k=K, query_chunk=512)[:2]
      f = jax.jit(sel)
      g = jax.jit(jax.grad(lambda q, w, k, sel=sel: jnp.sum(by_entry(*sel(q, w, k), N) * r),
                           argnums=(0, 1, 2)))
      for mode, fn in (("fwd (scores+top-k)", f), ("fwd+bwd", g)):
        t = guarded(f"idx {shape} {name} {mode}", lambda: time_calls(fn, q, w, idx_k, reps=reps))
        if t:
          rate(name, mode, t)
          times[(name, mode)] = t[0]
  at_bench(q, w, idx_k, seg, pos, K, interp, reps, shape)
  base = times.get(("xla chunk512", "fwd (scores+top-k)"))
  for (name, mode), t in times.items():
    if base and mode == "fwd (scores+top-k)" and name != "xla chunk512":
      emit(kind="check", what="indexer scores + selection over the XLA reference's",
           shape=shape, impl=name, speedup=base / t)


def at_bench(q, w, idx_k, seg, pos, K, interp, reps, shape):
  """The selected entries' scores alone (`scores_at`, the KL loss's gradient path), in 512-row
  chunks as `score_and_select` runs it, on the kernel's own selection: the Triton kernels against
  the XLA form (`scores_at_xla`), forward and forward + backward (r · scores), and the two
  gradients' agreement. Useful FLOPs: 2 products of B·T·K·H_I·D_I forward, ×3 with the backward."""
  topk, _ = jax.jit(partial(kx.score_and_select, k=K, interpret=interp))(q, w, idx_k, seg, pos,
                                                                          seg)
  B, T, H, I = q.shape
  r = jax.random.normal(jax.random.PRNGKey(11), topk.shape, jnp.float32)
  fl = 4.0 * B * T * topk.shape[-1] * H * I
  grads = {}
  # The Triton kernels at their defaults (block_k 128, 4 warps: "scores_at triton") and at other
  # slot chunks / warps, then the XLA form.
  forms = [("scores_at triton", kx.scores_at)] + [
      (f"scores_at triton k{bk} w{nw}",
       lambda q, w, k, i, interp, bk=bk, nw=nw: kx.scores_at(q, w, k, i, interp, bk, nw))
      for bk, nw in ((64, 4), (32, 4), (128, 8))] + [("scores_at xla", kx.scores_at_xla)]
  for name, fn in forms:
    at = lambda q, w, k, fn=fn: kx._row_chunks(lambda q, w, i: fn(q, w, k, i, interp), T, 512,
                                               (q, w, topk))
    g = jax.jit(jax.grad(lambda q, w, k, at=at: jnp.sum(at(q, w, k) * r), argnums=(0, 1, 2)))
    grads[name] = guarded(f"idx {shape} {name} grads", lambda: g(q, w, idx_k))
    for mode, f, n_fl in (("fwd", jax.jit(at), fl), ("fwd+bwd", g, 3 * fl)):
      t = guarded(f"idx {shape} {name} {mode}", lambda: time_calls(f, q, w, idx_k, reps=reps))
      if t:
        emit(kind="indexer", shape=shape, impl=name, mode=mode, ms=1e3 * t[0], first_s=t[1],
             tflops=n_fl / t[0] / 1e12, of_ceiling=n_fl / t[0] / CEILING)
  a, b = grads["scores_at triton"], grads["scores_at xla"]
  if a is not None and b is not None:
    emit(kind="check", what="scores_at Triton vs XLA gradients (bf16)", shape=shape,
         rel_dq=rel(a[0], b[0]), rel_dw=rel(a[1], b[1]), rel_dk=rel(a[2], b[2]))


def topk_bench(B, T, K, interp, reps):
  """Selection alone over [B, T, N = T] causal scores: `lax.top_k` (`select_topk`) vs the radix
  threshold select (`pallas_kernels.topk_select`) vs its one-program-per-row Triton form
  (`pallas_kernels.topk_triton`), and whether their sets (and the two radix forms' slots) agree
  (scores rounded to bf16 so that ties occur)."""
  s = jax.random.normal(jax.random.PRNGKey(3), (B, T, T)).astype(jnp.bfloat16).astype(jnp.float32)
  vis = jnp.broadcast_to(jnp.arange(T)[None, :] <= jnp.arange(T)[:, None], (B, T, T))
  shape = f"{B}x{T} N{T} K{K}"
  ref = jax.jit(lambda s: ix.select_topk(s, vis, K)[0])
  rad = jax.jit(lambda s: tsel.radix_topk(s, vis, K))
  # The Triton forms: τ 1, 2 or 4 bits per reduction with the keys made by XLA (1 bit: the first
  # form's passes), and 4 or 1 bits with the keys made in the kernel from the masked scores (−inf
  # where invisible: the indexer's `score_and_select`, at `triton_topk`'s default bits).
  masked = jnp.where(vis, s, -jnp.inf)
  tri1 = jax.jit(lambda s: ttk.triton_topk(s, vis, K, interpret=interp, digit_bits=1))
  tri2 = jax.jit(lambda s: ttk.triton_topk(s, vis, K, interpret=interp, digit_bits=2))
  tri = jax.jit(lambda s: ttk.triton_topk(s, vis, K, interpret=interp, digit_bits=4))
  tri_in = jax.jit(lambda m: ttk.triton_topk(m, None, K, interpret=interp, digit_bits=4))
  tri_in1 = jax.jit(lambda m: ttk.triton_topk(m, None, K, interpret=interp, digit_bits=1))
  tri_early = jax.jit(lambda m: ttk.triton_topk(m, None, K, interpret=interp, early_exit=True))
  same = bool(jnp.all(jnp.sort(ref(s), -1) == jnp.sort(rad(s), -1)))
  emit(kind="check", what="radix top-k set == lax.top_k set", shape=shape, equal=same)
  for name, f, x in (("bits 1", tri1, s), ("bits 4", tri, s), ("bits 4, keys in kernel", tri_in,
                                                               masked),
                     ("bits 1, keys in kernel, early exit", tri_early, masked)):
    same = guarded(f"topk {shape} triton {name} check", lambda: bool(jnp.all(f(x) == rad(s))))
    emit(kind="check", what=f"Triton top-k ({name}) slots == radix top-k slots", shape=shape,
         equal=same)
  for name, f, x in (("lax.top_k (select_topk)", ref, s), ("radix select", rad, s),
                     ("triton select bits 1", tri1, s), ("triton select bits 2", tri2, s),
                     ("triton select bits 4", tri, s),
                     ("triton select in-kernel", tri_in, masked),
                     ("triton select in-kernel bits 1", tri_in1, masked),
                     ("triton select in-kernel early exit", tri_early, masked)):
    t = guarded(f"topk {shape} {name}", lambda: time_calls(f, x, reps=reps))
    if t:
      emit(kind="indexer", shape=shape, impl=name, mode="selection", ms=1e3 * t[0], first_s=t[1],
           tflops=0.0, of_ceiling=0.0)


def table():
  print(f"\n{header()}\n({elapsed():.0f} s)")
  for r in ROWS:
    if r["kind"] == "stage":
      print(f"stage   {r['shape']:32s} {r['stage']:32s} {r['ms']:9.2f} ms")
    elif r["kind"] == "ratio":
      masked = "" if r["over_masked"] is None else f", over masked {r['over_masked']:.2f}x"
      print(f"ratio   {r['shape']:32s} {r['mode']:8s} {r['kernel']}: over best XLA "
            f"{r['over_best_xla']:.2f}x{masked}"
            + (" (SLOWER than an XLA form)" if r["slower_than_an_xla_form"] else ""))
    elif r["kind"] in ("attn", "indexer"):
      print(f"{r['kind']:7s} {r['shape']:32s} {r['impl']:22s} {r['mode']:19s} {r['ms']:9.2f} ms "
            f"{r['tflops']:7.1f} TF/s {100 * r['of_ceiling']:5.1f}%")
    else:
      print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})


def main():
  interp = jax.default_backend() == "cpu"
  reps = ARGS.reps
  if not ARGS.cases or "check" in ARGS.cases.split(","):
    guarded("attn check", lambda: attn_check(interp))
    guarded("idx check", lambda: idx_check(interp))
  if ARGS.smoke:
    attn_bench(1, 64, 2, interp, 1, xla_impls=(("masked", None), ("gather", None)), H=4, D=32,
               W=8, K=8)
    attn_bench(1, 64, 2, interp, 1, (), kernels=("csa2 probs apart", "csa2 fwd bk32"), H=4,
               D=32, W=8, K=8)
    attn_bench(1, 64, 2, interp, 1, H=4, D=32, W=8, K=8, kernels=("pallas csa2",),
               global_branch=False)
    idx_bench(64, interp, 1, H=4, I=32, K=8, variants=((16, 16, 4), (16, 16, 4, 32)), B=2)
    attn_remat(1, 64, 2, interp, 1, H=4, D=32, W=8, K=8)
    attn_breakdown(1, 64, 2, interp, 1, H=4, D=32, W=8, K=8)
    topk_bench(2, 64, 8, interp, 1)
    table()
    return
  # s3's shapes (16 heads x 128, window 128, top-256), 16K tokens per call. "masked" at 32K+
  # needs query chunks to fit in memory. `--cases` picks and orders them (the deadline skips the
  # rest).
  both = (("masked", None), ("gather", None))
  cases = {
      "4k-m1": lambda: attn_bench(4, 4096, 1, interp, reps, both),
      "4k-m1-variants": lambda: attn_bench(4, 4096, 1, interp, reps, (),
                                           kernels=("pallas csa2",) + tuple(VARIANTS)),
      "4k-m1-tiles": lambda: attn_bench(4, 4096, 1, interp, reps, (),
                                        kernels=("pallas csa2",) + tuple(TILES)[:4]),
      "4k-m1-launch": lambda: attn_bench(4, 4096, 1, interp, reps, (),
                                         kernels=("pallas csa2",) + tuple(TILES)[4:]),
      "4k-m1-stages": lambda: attn_breakdown(4, 4096, 1, interp, reps),
      "4k-m1-remat": lambda: attn_remat(4, 4096, 1, interp, reps),
      "4k-m2": lambda: attn_bench(4, 4096, 2, interp, reps, both),
      # s3's two SWA layers run the reference ("auto": window-only is outside the envelope).
      "4k-swa": lambda: attn_bench(4, 4096, 1, interp, reps, (("masked", None),),
                                   kernels=("pallas csa2",), global_branch=False),
      "topk-4k": lambda: topk_bench(4, 4096, 256, interp, reps),
      "idx-4k": lambda: idx_bench(4096, interp, reps, H=16, I=128, K=256, B=4),
      # the scores kernel over entry chunks (more, more even programs than one a query block;
      # 512, the default since session 59, against whole rows and larger chunks)
      "idx-4k-chunks": lambda: idx_bench(4096, interp, reps, xla=False, H=16, I=128, K=256, B=4,
                                         variants=((64, 128, 4), (64, 128, 4, 512),
                                                   (64, 128, 4, 1024), (64, 128, 4, 2048),
                                                   (64, 128, 4, 256))),
      # the scores kernel's tiles (block_t queries, block_n entries, warps) at s3's shapes over
      # the default 512-entry chunks; each with the early-exit select, forward and backward (the
      # first with every select)
      "idx-4k-tiles": lambda: idx_bench(4096, interp, reps, xla=False, H=16, I=128, K=256, B=4,
                                        variants=((64, 128, 4, 512), (128, 64, 4, 512),
                                                  (64, 64, 4, 512), (128, 128, 8, 512),
                                                  (64, 64, 8, 512), (32, 64, 4, 512))),
      # m3's and s4's top-512 (configs/small.py): the measured envelopes stop at top-256.
      "4k-m1-k512": lambda: attn_bench(4, 4096, 1, interp, reps, both, K=512),
      "4k-m2-k512": lambda: attn_bench(4, 4096, 2, interp, reps, both, K=512),
      "topk-4k-k512": lambda: topk_bench(4, 4096, 512, interp, reps),
      "idx-4k-k512": lambda: idx_bench(4096, interp, reps, H=16, I=128, K=512, B=4),
      "32k-m2": lambda: attn_bench(1, 32768, 2, interp, reps, (("masked", 4096), ("gather", None))),
      "32k-m1": lambda: attn_bench(1, 32768, 1, interp, reps, (("masked", 2048), ("gather", None))),
      "16k-m1": lambda: attn_bench(1, 16384, 1, interp, reps, both),
      "16k-m2": lambda: attn_bench(1, 16384, 2, interp, reps, both),
      "64k-m2": lambda: attn_bench(1, 65536, 2, interp, 3, (("masked", 2048), ("gather", None)),
                                   kernels=tuple(KERNELS)),
      "64k-m1": lambda: attn_bench(1, 65536, 1, interp, 3, (("masked", 1024), ("gather", None)),
                                   kernels=tuple(KERNELS)),
  }
  for name in (ARGS.cases.split(",") if ARGS.cases else cases):
    if name == "check":
      continue
    guarded(name, cases[name])
  table()


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
  ap.add_argument("--deadline", type=float, default=175.0, help="seconds; later cases are skipped")
  ARGS = ap.parse_args()
  main()
