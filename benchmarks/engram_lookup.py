"""Engram table lookup + gradient timing (docs/design.md §7.3, `dsv41_jax.engram.lookup`).

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
    python benchmarks/engram_lookup.py --rows=1048576 --dim=64 --tokens=4096 --heads=24

Times, for a [rows, dim] float32 table and `tokens` × `heads` row ids (uniform random):
  gather    E = table[ids]                              (forward only)
  fwd+bwd   value and table gradient of Σ E·c           (gather + row scatter-add)
  hash      host numpy `engram_hash_ids` for one packed row of `tokens` tokens with the flash
            hash constants (24 ids per token)
each on one device, and — when more than one device is visible — row-sharded over an `engram` mesh
axis of all devices (the shard_map path; on a CPU host the "devices" share the same cores, so this
measures overhead, not speed-up). Reports the median of --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks.common import median_seconds  # noqa: E402
from dsv41_jax import sharding  # noqa: E402
from dsv41_jax.config import ModelConfig  # noqa: E402
from dsv41_jax.engram import hashing, lookup  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=1 << 20)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=24)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()

  rng = np.random.default_rng(0)
  rows = lookup.padded_rows(args.rows)
  table = jnp.asarray(rng.normal(size=(rows, args.dim)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, args.rows, size=(args.tokens, args.heads)), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(args.tokens, args.heads, args.dim)), jnp.float32)

  gather = jax.jit(lookup.engram_lookup)
  fwd_bwd = jax.jit(jax.value_and_grad(lambda t, i: jnp.sum(lookup.engram_lookup(t, i) * cot)))
  out = {"rows": rows, "dim": args.dim, "tokens": args.tokens, "heads": args.heads,
         "backend": jax.default_backend(), "devices": jax.device_count()}
  out["gather_ms"] = 1e3 * median_seconds(gather, table, ids, reps=args.repeats)
  out["fwd_bwd_ms"] = 1e3 * median_seconds(fwd_bwd, table, ids, reps=args.repeats)

  if jax.device_count() > 1:
    mesh = sharding.make_mesh({"engram": jax.device_count()})
    with jax.set_mesh(mesh):
      t_s = jax.device_put(table, NamedSharding(mesh, P("engram", None)))
      out["sharded_gather_ms"] = 1e3 * median_seconds(gather, t_s, ids, reps=args.repeats)
      out["sharded_fwd_bwd_ms"] = 1e3 * median_seconds(fwd_bwd, t_s, ids, reps=args.repeats)

  # Host hashing: the flash hash constants (24 ids per token) on a packed row of `tokens` tokens.
  cfg = ModelConfig()
  hp = hashing.engram_hash_params(cfg, cfg.engram_layer_ids[0])
  toks = rng.integers(0, cfg.engram_compressed_vocab_size, size=(1, args.tokens))
  seg = np.repeat(np.arange(1, 5), args.tokens // 4 + 1)[None, :args.tokens]
  t = time.perf_counter()
  for _ in range(args.repeats):
    hashing.engram_hash_ids(toks, seg, None, hp)
  out["host_hash_ms_per_row"] = 1e3 * (time.perf_counter() - t) / args.repeats
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
