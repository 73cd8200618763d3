"""CSA2 indexer scoring + top-k on one GPU, by query chunk (docs/design.md §5.4; dsv41_jax/layers/indexer.py).

  python benchmarks/indexer_gpu.py                    # H200: V4.1-Flash indexer shapes
  python benchmarks/indexer_gpu.py --smoke            # CPU: tiny shapes

For each sequence length T (m = 1, so N = T entries; one document per row) and `query_chunk`, the
table gives the median wall time of the forward (scores, visibility, top-k) and of forward +
backward of Σ r·scores_at_topk (the indexer loss's path: gradients to q, w and index_k), and XLA's
temporary-buffer size for the backward program (`compiled.memory_analysis().temp_size_in_bytes`).
The score matmul is H_I·D_I·2 FLOP per (query, entry) pair; the "TFLOP/s" column counts all T·N
pairs of the forward (the causal half is computed and masked, not skipped).

Imports only jax/numpy and this repository, so it runs on the GPU machine without the data stack.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.common import header, md_header, median_seconds
from dsv41_jax.layers.indexer import score_and_select
from dsv41_jax.layers.types import CompressedKV


def run_case(t: int, chunk: int, h: int, d: int, k: int, reps: int, dtype) -> dict:
  key = jax.random.split(jax.random.key(t + chunk), 4)
  q = jax.random.normal(key[0], (1, t, h, d), dtype)
  w = jax.random.normal(key[1], (1, t, h), jnp.float32)
  idx_k = jax.random.normal(key[2], (1, t, d), dtype)
  r = jax.random.normal(key[3], (1, t, min(k, t)), jnp.float32)
  seg = jnp.ones((1, t), jnp.int32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  meta = (seg, pos, pos)  # m = 1: entry g is token g (segment 1, last row g, position g)

  def fwd(q, w, idx_k):
    kv = CompressedKV(jnp.zeros((1, t, 1), dtype), idx_k, *meta)
    return score_and_select(q, w, kv, seg, k=k, query_chunk=chunk)[:2]

  def loss(q, w, idx_k):
    return jnp.sum(fwd(q, w, idx_k)[1] * r)

  f = jax.jit(fwd)
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  temp = g.lower(q, w, idx_k).compile().memory_analysis().temp_size_in_bytes
  t_f = median_seconds(f, q, w, idx_k, reps=reps)
  t_g = median_seconds(g, q, w, idx_k, reps=reps)
  flops = 2.0 * t * t * h * d
  return dict(T=t, chunk=chunk, fwd_ms=1e3 * t_f, fwdbwd_ms=1e3 * t_g,
              tflops=flops / t_f / 1e12, temp_gib=temp / 2**30)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--reps", type=int, default=3)
  args = ap.parse_args()
  if args.smoke:
    cases = [(64, c) for c in (16, 64)]
    h, d, k = 4, 16, 8
  else:
    cases = [(16384, c) for c in (512, 2048)] + [(65536, c) for c in (512,)]
    h, d, k = 32, 128, 512
  print(header())
  print(f"H_I={h} D_I={d} k={k} bf16 q/k\n")
  print(md_header("T", "query_chunk", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "bwd temp GiB"))
  for t, c in cases:
    try:
      o = run_case(t, c, h, d, k, args.reps, jnp.bfloat16)
      print(f"| {o['T']} | {o['chunk']} | {o['fwd_ms']:.1f} | {o['tflops']:.0f} | "
            f"{o['fwdbwd_ms']:.1f} | {o['temp_gib']:.2f} |", flush=True)
    except Exception as e:  # an out-of-memory case is a result too
      print(f"| {t} | {c} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | |",
            flush=True)


if __name__ == "__main__":
  main()
