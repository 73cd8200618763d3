"""CSA2 Pallas kernels vs the XLA forms, one device call (issue 13; docs/design.md §4.3, §5.4).

  PYTHONUNBUFFERED=1 python benchmarks/csa2_kernels_gpu.py            # H200, writes $OUT/csa2.json
  JAX_PLATFORMS=cpu python benchmarks/csa2_kernels_gpu.py --smoke      # CPU: tiny, interpreted

1. Correctness on the GPU (bf16 inputs, against float32 references on the same inputs):
   sparse attention o, global_probs and the gradients (q, kv, entries, sink) vs `attend_reference`;
   indexer scores vs `indexer_scores` + `entry_visible`, and the kernel's top-k sets vs XLA's.
2. Sparse attention (H 16, D 256, window 128, m 2, top-512 distinct causal entries, sink; loss
   Σ o², global_probs computed and detached, as `benchmarks/attention_cpu.py`): kernel vs the best
   XLA form ("masked" to 16K, "gather" at 32K, RESULTS.md), forward and forward + backward.
   Useful FLOPs: 4·B·T·H·D·(W + K) forward (QK + PV at the keys attended), ×3 with the backward.
3. Indexer (H_I 32, D_I 128, top-512, m 1, one document): the kernel's scores alone, scores +
   top-k (the forward `score_and_select`), and forward + backward of Σ r·scores_at_topk, vs the XLA
   `score_and_select` (query_chunk 512). FLOPs: 2·T·N·H_I·D_I (all pairs, as the RESULTS table
   counts; the causal half is the useful part, which the kernel skips block-wise).
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
from dsv41_jax.layers import sparse_attention as sa
from dsv41_jax.layers.types import CompressedKV, entry_visible
from pallas_kernels import indexer as kx
from pallas_kernels import sparse_attention as ks

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
  vis = (jnp.arange(N)[None, :] + 1) * m <= jnp.arange(T)[:, None] + 1
  score = jnp.where(vis, jax.random.normal(k[3], (B, T, N)), -jnp.inf)
  val, idx = jax.lax.top_k(score, K)
  topk = jnp.where(jnp.isfinite(val), idx, -1).astype(jnp.int32)
  return q, kv, g, sink, seg, topk


def attn_fns(fn, W, D):
  def fwd(q, kv, g, sink, seg, topk):
    return fn(q, kv, seg, sink, window=W, scale=D ** -0.5, global_kv_BxNxD=g, topk_BxTxK=topk)

  def loss(q, kv, g, sink, seg, topk):
    o, p = fwd(q, kv, g, sink, seg, topk)
    return jnp.sum(o.astype(jnp.float32) ** 2), jax.lax.stop_gradient(p)

  return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def attn_check(interp):
  B, T, H, D, W, m, K = (1, 2048, 16, 256, 128, 2, 512) if not ARGS.smoke else (1, 48, 4, 32, 8, 2, 8)
  x = attn_inputs(B, T, H, D, m, K, jnp.bfloat16, seed=1)
  x32 = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in x)
  kf, kg = attn_fns(partial(ks.sparse_attend, interpret=interp), W, D)
  rf, rg = attn_fns(sa.attend_reference, W, D)
  o, p = kf(*x)
  ro, rp = rf(*x32)
  (_, _), gk = kg(*x)
  # The reference's loss uses its own o; compare gradients of the same function at the same point.
  (_, _), gr = rg(*x32)
  emit(kind="check", what="sparse_attention bf16 vs f32 reference", shape=f"B{B} T{T} H{H} D{D} K{K}",
       rel_o=rel(o, ro), rel_probs=rel(p, rp), rel_dq=rel(gk[0], gr[0]), rel_dkv=rel(gk[1], gr[1]),
       rel_dglobal=rel(gk[2], gr[2]), rel_dsink=rel(gk[3], gr[3]))


def attn_bench(B, T, xla_impl, interp, reps, H=16, D=256, W=128, m=2, K=512,
               variants=((64, 32, 4),)):
  x = attn_inputs(B, T, H, D, m, K, jnp.bfloat16)
  fl = 4.0 * B * T * H * D * (W + K)
  shape = f"{B}x{T} H{H} D{D} N{T // m} K{K}"
  res = {}
  for bk, bkb, nw in variants:   # key chunk forward, backward; warps
    name = f"pallas bk{bk}/{bkb} w{nw}"
    kf, kg = attn_fns(partial(ks.sparse_attend, interpret=interp, block_k=bk, block_k_bwd=bkb,
                              num_warps=nw), W, D)
    for mode, f, mult in (("fwd", kf, 1), ("fwd+bwd", kg, 3)):
      r = guarded(f"attn {shape} {name} {mode}", lambda: time_calls(f, *x, reps=reps))
      if r:
        res[(name, mode)] = r[0]
        emit(kind="attn", shape=shape, impl=name, mode=mode, ms=1e3 * r[0], first_s=r[1],
             tflops=mult * fl / r[0] / 1e12, of_ceiling=mult * fl / r[0] / CEILING)
  xf, xg = attn_fns(partial(sa.attend, impl=xla_impl), W, D)
  for mode, f, mult in (("fwd", xf, 1), ("fwd+bwd", xg, 3)):
    r = guarded(f"attn {shape} xla {xla_impl} {mode}", lambda: time_calls(f, *x, reps=reps))
    if r:
      res[("xla", mode)] = r[0]
      emit(kind="attn", shape=shape, impl=f"xla {xla_impl}", mode=mode, ms=1e3 * r[0], first_s=r[1],
           tflops=mult * fl / r[0] / 1e12, of_ceiling=mult * fl / r[0] / CEILING)
  return res


# --- indexer ------------------------------------------------------------------------------------

def idx_inputs(T, H, I, K, dtype, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(k[0], (1, T, H, I), dtype)
  w = jax.random.normal(k[1], (1, T, H), jnp.float32) * H ** -0.5
  idx_k = jax.random.normal(k[2], (1, T, I), dtype)
  r = jax.random.normal(k[3], (1, T, min(K, T)), jnp.float32)
  seg = jnp.ones((1, T), jnp.int32)
  pos = jnp.arange(T, dtype=jnp.int32)[None]
  return q, w, idx_k, r, seg, pos


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
  emit(kind="check", what="indexer bf16 kernel vs XLA", shape=f"T{T} H{H} I{I} K{K}",
       mask_equal=same_mask, max_score_err_rel_to_max=err,
       rows_same_topk_set=float(jnp.mean(same)))


def idx_bench(T, interp, reps, xla=True, H=32, I=128, K=512, variants=((64, 64, 4),)):
  q, w, idx_k, r, seg, pos = idx_inputs(T, H, I, K, jnp.bfloat16)
  fl = 2.0 * T * T * H * I
  shape = f"T{T} H{H} I{I} K{K} m1"
  row = lambda **kw: emit(kind="indexer", shape=shape, **kw)

  def rate(impl, mode, t):
    row(impl=impl, mode=mode, ms=1e3 * t[0], first_s=t[1], tflops=fl / t[0] / 1e12,
        of_ceiling=fl / t[0] / CEILING)

  for bt, bn, nw in variants:
    name = f"pallas t{bt} n{bn} w{nw}"
    f = jax.jit(partial(kx.masked_scores, block_t=bt, block_n=bn, num_warps=nw, interpret=interp))
    t = guarded(f"idx {shape} {name} scores",
                lambda: time_calls(f, q, w, idx_k, seg, pos, seg, jnp.arange(T), reps=reps))
    if t:
      rate(name, "scores only", t)
  bt, bn, nw = variants[0]
  sel = partial(kx.score_and_select, k=K, interpret=interp, block_t=bt, block_n=bn, num_warps=nw)
  f = jax.jit(lambda q, w, k: sel(q, w, k, seg, pos, seg))
  g = jax.jit(jax.grad(lambda q, w, k: jnp.sum(sel(q, w, k, seg, pos, seg)[1] * r),
                       argnums=(0, 1, 2)))
  for mode, fn in (("fwd (scores+top-k)", f), ("fwd+bwd", g)):
    t = guarded(f"idx {shape} pallas {mode}", lambda: time_calls(fn, q, w, idx_k, reps=reps))
    if t:
      rate(f"pallas t{bt} n{bn} w{nw}", mode, t)
  if xla:
    kv = lambda k: CompressedKV(None, k, seg, pos, pos)
    f = jax.jit(lambda q, w, k: ix.score_and_select(q, w, kv(k), seg, k=K, query_chunk=512)[:2])
    g = jax.jit(jax.grad(lambda q, w, k: jnp.sum(
        ix.score_and_select(q, w, kv(k), seg, k=K, query_chunk=512)[1] * r), argnums=(0, 1, 2)))
    for mode, fn in (("fwd (scores+top-k)", f), ("fwd+bwd", g)):
      t = guarded(f"idx {shape} xla {mode}", lambda: time_calls(fn, q, w, idx_k, reps=reps))
      if t:
        rate("xla chunk512", mode, t)


def table():
  print(f"\n{header()}\n({elapsed():.0f} s)")
  for r in ROWS:
    if r["kind"] in ("attn", "indexer"):
      print(f"{r['kind']:7s} {r['shape']:28s} {r['impl']:22s} {r['mode']:19s} {r['ms']:9.2f} ms "
            f"{r['tflops']:7.1f} TF/s {100 * r['of_ceiling']:5.1f}%")
    else:
      print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})


def main():
  interp = jax.default_backend() == "cpu"
  reps = ARGS.reps
  guarded("attn check", lambda: attn_check(interp))
  guarded("idx check", lambda: idx_check(interp))
  if ARGS.smoke:
    attn_bench(1, 64, "masked", interp, 1, H=4, D=32, W=8, K=8, variants=((8, 8, 4),))
    idx_bench(64, interp, 1, H=4, I=32, K=8, variants=((16, 16, 4),))
  else:
    attn_bench(2, 4096, "masked", interp, reps)
    attn_bench(1, 32768, "gather", interp, reps, variants=((64, 32, 4), (64, 64, 4), (32, 32, 4)))
    idx_bench(16384, interp, reps, variants=((64, 64, 4), (64, 128, 8), (128, 64, 8)))
    attn_bench(1, 16384, "masked", interp, reps)
    idx_bench(65536, interp, 1, xla=False)
  table()


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--deadline", type=float, default=175.0, help="seconds; later cases are skipped")
  ARGS = ap.parse_args()
  main()
