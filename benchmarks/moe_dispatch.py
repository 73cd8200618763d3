"""Routed-expert dispatch timing: dropless (ragged_dot) vs capacity (batched einsum) vs dense.

  python benchmarks/moe_dispatch.py                                   # 2-core CPU sizes
  python benchmarks/moe_dispatch.py --tokens 16384 --d 1536 --f 768 --experts 64 --k 6 \
      --dtype bfloat16                                                # GPU sizes of docs/design.md §T7

Times `moe_dispatch.routed_experts` (docs/design.md §8.2, dsv41_jax/layers/moe_dispatch.py) on one device
for fixed routing (random router logits through `moe.route`), forward and forward + backward
(gradients to x and the three expert weights), against a dense reference that runs every expert
on every token and weights the outputs by the (mostly zero) gate matrix. Reports the median of
--reps runs after one warm-up: milliseconds, tokens/s, and useful TFLOP/s (3 matmuls of
2·d·f FLOP per routed pair; ×3 for forward + backward), the same count for all three methods.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import header, md_header, median_seconds
from dsv41_jax.layers import moe_dispatch
from dsv41_jax.layers.moe import route


def dense_reference(x_NxD, weights_NxK, experts_NxK, w1, w3, w2, limit):
  """Every expert on every token; the gate matrix keeps the routed ones."""
  dt = x_NxD.dtype
  gate_NxE = jnp.einsum("nk,nke->ne", weights_NxK,
                        jax.nn.one_hot(experts_NxK, w1.shape[0], dtype=jnp.float32))
  a = jnp.einsum("nd,edf->enf", x_NxD, w1.astype(dt), preferred_element_type=jnp.float32)
  u = jnp.einsum("nd,edf->enf", x_NxD, w3.astype(dt), preferred_element_type=jnp.float32)
  h = moe_dispatch.clamped_swiglu(a, u, limit).astype(dt)
  y = jnp.einsum("enf,efd->end", h, w2.astype(dt), preferred_element_type=jnp.float32)
  return jnp.einsum("end,ne->nd", y, gate_NxE)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=2048)
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--f", type=int, default=128)
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--k", type=int, default=2)
  ap.add_argument("--capacity_factor", type=float, default=1.25)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--no-dense", action="store_true")
  args = ap.parse_args()

  n, d, f, e, k = args.tokens, args.d, args.f, args.experts, args.k
  dt = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (1, n, d), dt)
  w1 = (jax.random.normal(keys[1], (e, d, f)) / np.sqrt(d)).astype(dt)
  w3 = (jax.random.normal(keys[2], (e, d, f)) / np.sqrt(d)).astype(dt)
  w2 = (jax.random.normal(keys[3], (e, f, d)) / np.sqrt(f)).astype(dt)
  logits = jax.random.normal(keys[4], (1, n, e))
  weights, experts, _ = route(logits, jnp.zeros(e), k, 1.5, 1.0)
  valid = jnp.ones((1, n), jnp.bool_)
  r = jax.random.normal(keys[5], (1, n, d), jnp.float32)
  limit = 10.0

  def method(name):
    if name == "dense":
      return lambda x, w1, w3, w2: dense_reference(x[0], weights[0], experts[0], w1, w3, w2,
                                                   limit)[None]
    return lambda x, w1, w3, w2: moe_dispatch.routed_experts(
        x, weights, experts, valid, w1, w3, w2, mode=name,
        capacity_factor=args.capacity_factor, swiglu_limit=limit)[0]

  names = ["dropless", "capacity"] + ([] if args.no_dense else ["dense"])
  useful = 3 * 2 * d * f * n * k
  cap = moe_dispatch.expert_capacity(n, k, e, args.capacity_factor)
  _, dropped = moe_dispatch.routed_experts(x, weights, experts, valid, w1, w3, w2,
                                           mode="capacity", capacity_factor=args.capacity_factor)
  print(header())
  print(f"tokens {n}, d {d}, f {f}, E {e}, k {k}, {dt.name}; capacity {cap} per expert (factor "
        f"{args.capacity_factor}), dropped {float(dropped.mean()):.3%} of pairs")
  print(md_header("method", "fwd ms", "fwd tokens/s", "fwd TFLOP/s", "fwd+bwd ms",
                  "fwd+bwd tokens/s", "fwd+bwd TFLOP/s"))
  for name in names:
    fwd = jax.jit(method(name))
    loss = lambda x, w1, w3, w2, fn=method(name): (fn(x, w1, w3, w2) * r).sum()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    t_f = median_seconds(fwd, x, w1, w3, w2, reps=args.reps)
    t_b = median_seconds(bwd, x, w1, w3, w2, reps=args.reps)
    print(f"| {name} | {t_f * 1e3:.2f} | {n / t_f:,.0f} | {useful / t_f / 1e12:.3f} | "
          f"{t_b * 1e3:.2f} | {n / t_b:,.0f} | {3 * useful / t_b / 1e12:.3f} |")


if __name__ == "__main__":
  main()
