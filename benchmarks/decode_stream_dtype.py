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

import numpy as np

from dsv41_jax import testing

T, N = 32, 11


def gaps(cfg) -> tuple[float, np.ndarray]:
  """(prefill's max |Δlogit|, decode's max |Δlogit| at each position from N − 1 on)."""
  dec, tokens, ref = testing.decode_reference(cfg, T)
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
  base = testing.inference_micro_config()
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
