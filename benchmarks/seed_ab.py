"""A loss A/B over seeds: two arms' held-out losses paired by seed (issue 27's bfloat16-stream A/B).

  python benchmarks/seed_ab.py --a 'DIR/f32_seed*' --b 'DIR/bf16_seed*' [--key eval/loss]

Each argument is a shell pattern of `launch.train` work directories whose names end in
`_seed<N>`; each run's figure is the last record with `--key` in its `metrics.jsonl` (the held-out
loss at the end of the run). Prints each seed's pair and B − A, each arm's mean and sample standard
deviation, the paired difference's mean, its standard error and a t statistic, and a plain verdict:
"within seed noise" when |mean difference| < 2 standard errors and < the arms' seed spread, else
which arm is lower and by how much; with one common seed there is no spread and no verdict (a
partial A/B is read as it comes in). Exit 2 when no seed is in both arms.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys


def last_value(run_dir: str, key: str) -> float | None:
  """The last `key` in run_dir/metrics.jsonl (None if absent)."""
  value = None
  try:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      for line in f:
        rec = json.loads(line)
        if key in rec:
          value = float(rec[key])
  except FileNotFoundError:
    return None
  return value


def arm(pattern: str, key: str) -> dict[int, float]:
  """{seed: figure} of the runs matching `pattern`."""
  out = {}
  for d in sorted(glob.glob(pattern)):
    m = re.search(r"_seed(\d+)$", d.rstrip("/"))
    v = last_value(d, key) if m else None
    if v is not None:
      out[int(m.group(1))] = v
  return out


def _mean_sd(x: list[float]) -> tuple[float, float]:
  return (statistics.fmean(x) if x else math.nan,
          statistics.stdev(x) if len(x) > 1 else math.nan)


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
  """The seeds in both arms, each arm's (mean, sd) over them, and the paired differences B − A."""
  seeds = sorted(set(a) & set(b))
  diffs = [b[s] - a[s] for s in seeds]
  arms = {name: _mean_sd([x[s] for s in seeds]) for name, x in (("A", a), ("B", b))}
  mean, sd = _mean_sd(diffs)
  se = sd / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
  spread = max(arms["A"][1], arms["B"][1])
  noise = len(diffs) > 1 and abs(mean) < 2 * se and abs(mean) < spread
  return dict(seeds=seeds, diffs=diffs, arms=arms, mean=mean, sd=sd, se=se,
              t=mean / se if se > 0 else math.nan, spread=spread, within_noise=noise)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--a", required=True, help="pattern of arm A's run directories (*_seed<N>)")
  ap.add_argument("--b", required=True, help="pattern of arm B's run directories (*_seed<N>)")
  ap.add_argument("--key", default="eval/loss")
  args = ap.parse_args(argv)
  a, b = arm(args.a, args.key), arm(args.b, args.key)
  r = compare(a, b)
  if not r["seeds"]:
    print(f"error: no seed in both arms (A: {sorted(a)}, B: {sorted(b)})", file=sys.stderr)
    return 2
  print(f"| seed | A {args.key} | B {args.key} | B − A |\n|---:|---:|---:|---:|")
  for s, d in zip(r["seeds"], r["diffs"]):
    print(f"| {s} | {a[s]:.4f} | {b[s]:.4f} | {d:+.4f} |")
  for name, (mean, sd) in r["arms"].items():
    print(f"{name}: mean {mean:.4f}, seed spread (sd) {sd:.4f} over {len(r['seeds'])} seeds")
  print(f"B − A: mean {r['mean']:+.4f}, sd {r['sd']:.4f}, standard error {r['se']:.4f}, "
        f"t {r['t']:+.2f}")
  if len(r["seeds"]) < 2:
    print("verdict: none yet (one seed: no seed spread to compare with)")
  elif r["within_noise"]:
    print("verdict: within seed noise")
  else:
    lower = "B" if r["mean"] < 0 else "A"
    print(f"verdict: {lower} lower by {abs(r['mean']):.4f} ({abs(r['t']):.1f} standard errors)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
