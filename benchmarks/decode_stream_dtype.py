"""Decode against the forward pass with float32 and bfloat16 mHC streams (design §3.5).

  python benchmarks/decode_stream_dtype.py [--all_experts] [--topk K]

The inference tests' micro model (`testing.tiny_config` with the candidate pool, capacity dispatch
that drops nothing; tests/dsv41_jax/inference/test_decode.py), 32 tokens: the forward pass's logits
are the reference; a full-depth prefill of 11 tokens, then one decode step at each later position.
Prints, per stream dtype, the prefill's largest |Δlogit| and the decode steps' largest |Δlogit| per
position. `--all_experts` routes every token to every expert and `--topk` sets the indexer's top-k,
which take the model's discrete choices away (benchmarks/RESULTS.md, session 44).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import model as M, testing
from dsv41_jax.inference import Decoder

T, N = 32, 11


def gaps(cfg) -> tuple[float, np.ndarray]:
  """(prefill's max |Δlogit|, decode's max |Δlogit| at each position from N − 1 on)."""
  model = M.init_model(cfg, 0)
  bias = jax.random.normal(jax.random.key(3), (cfg.num_hidden_layers, 2, cfg.n_routed_experts)) * 0.1
  dec = Decoder(model, bias, stored_formats=False)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
  batch = dict(tokens=jnp.asarray(tokens), positions=jnp.arange(T)[None],
               segment_ids=jnp.ones((1, T), jnp.int32),
               engram_ids={k: jnp.asarray(v) for k, v in dec.engram_ids(tokens).items()})
  ref = np.asarray(jax.jit(lambda b: model(b, bias)[0])(batch))[0]
  last, cache = dec.prefill(tokens[:, :N], T, depth="full")
  rows = [np.asarray(last)[0]]
  for t in range(N, T):
    logits, cache = dec.step(cache, tokens, t)
    rows.append(np.asarray(logits)[0])
  d = np.abs(np.stack(rows) - ref[N - 1:])
  return float(np.abs(rows[0] - ref[N - 1]).max()), d.max(-1)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--all_experts", action="store_true")
  ap.add_argument("--topk", type=int, default=None)
  args = ap.parse_args()
  base = testing.tiny_config(index_head_dim=32, use_candidate_pool=True,
                             candidate_source_layer_id=4, candidate_block_size=2,
                             candidate_topk_blocks=2, moe_dispatch="capacity",
                             moe_capacity_factor=2.0)
  extra = dict(num_experts_per_tok=base.n_routed_experts) if args.all_experts else {}
  if args.topk:
    extra["index_topk"] = args.topk
  for dtype in ("float32", "bfloat16"):
    cfg = dataclasses.replace(base, hc_stream_dtype=dtype, **extra)
    pre, per_pos = gaps(cfg)
    print(f"{dtype}: experts {cfg.num_experts_per_tok} of {cfg.n_routed_experts}, top-"
          f"{cfg.index_topk}; prefill's last row {pre:.2e}; decode max |Δlogit| per position "
          f"{np.array2string(per_pos, precision=6)}", flush=True)


if __name__ == "__main__":
  main()
