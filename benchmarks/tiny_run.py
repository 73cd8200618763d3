"""The README's main job, measured: the tiny pre-training run on the default corpus.

  python benchmarks/tiny_run.py [--workdir /tmp/dsv41_tiny_bench] [--overrides ...]

Runs `python -m launch.train --config=configs/tiny.py` in a fresh work directory, then reports the
wall time, the held-out loss and bits per byte of the last evaluation, and the corpus's unigram
entropy for comparison: H = −Σ_v p(v) ln p(v), with p the frequency of each target token over
the loss-masked targets of the held-out split (the best loss a model ignoring all context can
reach on that split, in nats per token).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import header, md_header  # noqa: E402


def unigram_entropy(cfg) -> tuple[float, int]:
  from data.config import data_config
  from data.pipeline import make_eval_iterator

  counts: collections.Counter = collections.Counter()
  for batch in make_eval_iterator(data_config(cfg.data), vocab_size=cfg.model.vocab_size):
    targets = batch["targets"][batch["loss_mask"]]
    counts.update(targets.tolist())
  n = sum(counts.values())
  return -sum(c / n * math.log(c / n) for c in counts.values()), n


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default="/tmp/dsv41_tiny_bench")
  ap.add_argument("overrides", nargs="*", help="extra --config.x=y flags for launch.train")
  args = ap.parse_args()
  shutil.rmtree(args.workdir, ignore_errors=True)
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny.py",
         f"--workdir={args.workdir}", "--config.train.progress_bar=False",
         "--config.train.eval_batches=0", *args.overrides]
  t0 = time.time()
  subprocess.run(cmd, check=True)
  wall = time.time() - t0
  evals, steps = [], []
  with open(os.path.join(args.workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "eval/loss" in r:
        evals.append(r)
      elif "step_time" in r:
        steps.append(r)
  from configs import tiny
  h, n = unigram_entropy(tiny.get_config())
  last = evals[-1]
  print(header())
  print(f"train command: python {' '.join(cmd[1:])}")
  print(md_header("wall s", "steps", "median step s", "held-out loss (nats/token)", "bits/byte",
                  "unigram entropy of held-out targets", "held-out tokens"))
  med = sorted(r["step_time"] for r in steps)[len(steps) // 2]
  print(f"| {wall:.0f} | {last['step']} | {med:.3f} | {last['eval/loss']:.3f} | "
        f"{last['eval/bits_per_byte']:.3f} | {h:.3f} | {n:,} |")
  for r in evals:
    print(f"  step {r['step']}: held-out loss {r['eval/loss']:.3f}, "
          f"bits/byte {r['eval/bits_per_byte']:.3f}")


if __name__ == "__main__":
  main()
