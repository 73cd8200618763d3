"""Two runs' losses side by side: an A/B of kernels against references (issue 27).

  python benchmarks/loss_ab.py A B [--tolerance 0.01]

A and B are `metrics.jsonl` files of `launch.train` (records with "step" and "loss") or JSON files
of `benchmarks/gpu_step.py --json` (one size each: its "losses", steps from 0). Prints step, loss A,
loss B, A − B and its size in bfloat16 ulps of the loss (2^(⌊log2 |B|⌋ − 7)), then the largest
|A − B| over the common steps; exit status 1 when it exceeds `--tolerance` (absolute), 2 when the
runs have no step in common.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def losses(path: str) -> dict[int, float]:
  """{step: loss} of a metrics.jsonl or a gpu_step JSON file (see module doc)."""
  with open(path) as f:
    text = f.read()
  try:
    rows = json.loads(text)
  except json.JSONDecodeError:
    rows = None
  if rows is not None and not isinstance(rows, dict):
    if len(rows) != 1 or "losses" not in rows[0]:
      raise SystemExit(f"error: {path}: expected one gpu_step row with 'losses'")
    return dict(enumerate(rows[0]["losses"]))
  out = {}
  for line in text.splitlines():
    if line.strip():
      r = json.loads(line)
      if "loss" in r and "step" in r:
        out[int(r["step"])] = float(r["loss"])
  return out


def bf16_ulps(diff: float, ref: float) -> float:
  return abs(diff) / 2.0 ** (math.floor(math.log2(abs(ref))) - 7) if ref else math.inf


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("a")
  ap.add_argument("b")
  ap.add_argument("--tolerance", type=float, default=0.01, help="largest |A − B| accepted")
  args = ap.parse_args(argv)
  la, lb = losses(args.a), losses(args.b)
  steps = sorted(set(la) & set(lb))
  if not steps:
    print(f"error: {args.a} and {args.b} have no step in common")
    return 2
  print("| step | loss A | loss B | A − B | bf16 ulps |\n|---:|---:|---:|---:|---:|")
  for s in steps:
    d = la[s] - lb[s]
    print(f"| {s} | {la[s]:.5f} | {lb[s]:.5f} | {d:+.2e} | {bf16_ulps(d, lb[s]):.2f} |")
  worst = max(abs(la[s] - lb[s]) for s in steps)
  print(f"\nlargest |A − B| over {len(steps)} steps: {worst:.3e} (tolerance {args.tolerance})")
  return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
  sys.exit(main())
