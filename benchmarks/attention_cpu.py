"""Time `sparse_attention.attend` (forward + backward) in its two global forms against the dense reference.

  python benchmarks/attention_cpu.py                       # 2-core CPU sizes
  python benchmarks/attention_cpu.py --T 4096 --H 64 --D 512 --K 512 --dtype bfloat16 --no-reference

MQA over a D-dim latent with H query heads, window W, N = T/m compressed entries, K selected per query
(distinct, causal, as the indexer picks them). "useful TFLOP/s" counts QK and PV at the keys actually
attended (W + K per query), ×3 for forward + backward ("window only": the same count, so its figure
is comparable as time, not as rate). global_probs is computed and detached, as in the model.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import header, median_seconds  # noqa: E402
from pallas_kernels.ops import sparse_attention as sa  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--B", type=int, default=1)
  ap.add_argument("--T", type=int, default=1024)
  ap.add_argument("--H", type=int, default=4)
  ap.add_argument("--D", type=int, default=64)
  ap.add_argument("--W", type=int, default=128)
  ap.add_argument("--m", type=int, default=2)
  ap.add_argument("--K", type=int, default=64)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--n", type=int, default=5, help="timed calls after the warm-up (median)")
  ap.add_argument("--no-reference", action="store_true")
  ap.add_argument("--query-chunk", type=int, default=None, help="rows per chunk (attend query_chunk)")
  ap.add_argument("--impls", default="masked,gather,window", help="which of masked,gather,window")
  a = ap.parse_args()
  B, T, H, D, W, m, K = a.B, a.T, a.H, a.D, a.W, a.m, a.K
  N = T // m
  dt = jnp.dtype(a.dtype)
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q = jax.random.normal(keys[0], (B, T, H, D), dt)
  kv = jax.random.normal(keys[1], (B, T, D), dt)
  g = jax.random.normal(keys[2], (B, N, D), dt)
  sink = jnp.zeros((H,), jnp.float32)
  seg = jnp.ones((B, T), jnp.int32)
  vis = (jnp.arange(N)[None, :] + 1) * m <= jnp.arange(T)[:, None] + 1
  score = jnp.where(vis, jax.random.normal(keys[3], (B, T, N)), -jnp.inf)
  val, idx = jax.lax.top_k(score, K)
  topk = jnp.where(jnp.isfinite(val), idx, -1).astype(jnp.int32)

  def loss(fn, q, kv, g, sink, seg, topk):
    # As in the model: the loss flows through o; global_probs is computed but detached.
    o, p = fn(q, kv, seg, sink, window=W, scale=D ** -0.5, global_kv_BxNxD=g, topk_BxTxK=topk)
    return jnp.sum(o.astype(jnp.float32) ** 2), jax.lax.stop_gradient(p)

  def loss_swa(q, kv, g, sink, seg, topk):
    o, _ = sa.attend(q, kv, seg, sink, window=W, scale=D ** -0.5, query_chunk=a.query_chunk)
    return jnp.sum(o.astype(jnp.float32) ** 2), g

  qc = a.query_chunk
  fns = {"masked": partial(loss, partial(sa.attend, impl="masked", query_chunk=qc)),
         "gather": partial(loss, partial(sa.attend, impl="gather", query_chunk=qc)),
         "window only": loss_swa}
  fns = {k: f for k, f in fns.items() if k.split()[0] in a.impls.split(",")}
  if not a.no_reference:
    fns["dense reference"] = partial(loss, sa.attend_reference)
  useful = 3 * 4 * B * T * H * (W + K) * D
  print(header())
  print(f"B{B} T{T} H{H} D{D} W{W} m{m} N{N} K{K} {a.dtype}, query_chunk {qc}, forward+backward")
  for name, fn in fns.items():
    # Inputs are arguments, not closed-over constants, so XLA cannot fold the mask at compile time.
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3), has_aux=True))
    try:
      t = median_seconds(step, q, kv, g, sink, seg, topk, reps=a.n)
      print(f"  {name:16s} {t * 1e3:9.2f} ms  {useful / t / 1e12:8.3f} useful TFLOP/s")
    except Exception as e:  # an out-of-memory size is a result too
      print(f"  {name:16s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")


if __name__ == "__main__":
  main()
