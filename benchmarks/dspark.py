"""DSpark on a trained backbone: the engine-throughput curve, acceptance, calibration, scheduler gain.

  python benchmarks/dspark.py --backbone=/tmp/dsv41_tiny --drafter=/tmp/dsv41_tiny_drafter \
      --curve_out=benchmarks/dspark_curve_tiny_cpu.json

1. Engine-throughput curve τ(R, k): seconds of one speculative round (drafter pass, host hashing,
   one backbone pass over k + 1 tokens per request, acceptance, rollback) for R requests at fixed
   verification length k = 0 … K, the median over the rounds of a greedy generation after a warm-up
   generation that compiles (`SpeculativeStats.seconds`). k = 0 is a plain decode step through the
   same path. Written as the JSON `launch.generate --throughput_curve` and the scheduler read.
2. On `--prompts` × `--requests` held-out prompts (the first `--prompt_len` tokens of the
   backbone's eval rows, `--requests` in flight at a time, greedy, `--new_tokens` each): per fixed k, the mean accepted drafts per round, the
   backbone passes per generated token (rounds / tokens; plain decoding: 1) and whether the tokens
   equal plain greedy decoding's; the confidence head's reliability (predicted c_i against realised
   acceptance, per position and per confidence bin, at k = K); the scheduler's run
   (k chosen per round from the confidences and τ) against every fixed k: tokens per second
   expected from the curve (Σ tokens / Σ τ(R, k_round)) and measured (Σ tokens / Σ round seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks.common import header, log, md_header


def prompts(loaded, n_rows: int, length: int) -> np.ndarray:
  """The first `length` tokens of held-out rows whose first document is at least that long."""
  from data.config import data_config
  from data.pipeline import make_eval_iterator
  from launch.train_drafter import backbone_config
  it = make_eval_iterator(data_config(backbone_config(loaded, n_rows).data),
                          tokenizer=loaded.tokenizer)
  out = []
  for rows in it:
    for tok, seg in zip(rows["tokens"], rows["segment_ids"]):
      if np.all(seg[:length] == seg[0]) and seg[0] > 0:
        out.append(tok[:length])
      if len(out) == n_rows:
        it.close()
        return np.stack(out).astype(np.int32)
  raise SystemExit(f"the eval split has fewer than {n_rows} rows with a {length}-token document")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--backbone", required=True)
  ap.add_argument("--drafter", required=True)
  ap.add_argument("--curve_out", default="benchmarks/dspark_curve.json")
  ap.add_argument("--batches", default="1")
  ap.add_argument("--requests", type=int, default=1)
  ap.add_argument("--prompts", type=int, default=6)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--new_tokens", type=int, default=48)
  ap.add_argument("--curve_tokens", type=int, default=16)
  args = ap.parse_args()

  from dsv41_jax.inference import scheduler
  from dsv41_jax.inference.speculative import SpeculativeDecoder, SpeculativeStats
  from launch.generate import load_model
  from launch.drafter import load_drafter

  loaded = load_model(args.backbone)
  drafter = load_drafter(args.drafter, loaded)
  dec = loaded.decoder()
  spec = SpeculativeDecoder(dec, loaded.model, drafter)
  K = spec.K
  limit = loaded.limit()
  print(header())
  print(f"backbone {args.backbone} (step {loaded.step}), drafter {args.drafter}, K = {K}, "
        f"stored cache formats: {dec.stored_formats}\n")

  # --- 1. the engine-throughput curve -------------------------------------------------------
  P = prompts(loaded, max(args.requests * args.prompts, max(int(b) for b in args.batches.split(","))),
              args.prompt_len)
  batches = [int(b) for b in args.batches.split(",")]
  seconds = []
  for R in batches:
    row = []
    for k in range(K + 1):
      run = lambda st: spec.generate(P[:R], args.curve_tokens, max_len=limit, temperature=0,
                                     verify_length=k, stats=st)
      run(SpeculativeStats())                                  # compiles
      st = SpeculativeStats()
      run(st)
      row.append(float(np.median(st.seconds)))
      log(f"curve R={R} k={k}: {row[-1] * 1e3:.1f} ms per round ({len(st.seconds)} rounds)")
    seconds.append(row)
  curve = scheduler.ThroughputCurve(tuple(batches), tuple(tuple(r) for r in seconds))
  with open(args.curve_out, "w") as f:
    json.dump({"batches": batches, "seconds": seconds, "command": " ".join(sys.argv)}, f, indent=1)
  print("Engine-throughput curve τ(R, k), ms per round (k drafts verified per request):\n")
  print(md_header("R", *[f"k={k}" for k in range(K + 1)]))
  for R, row in zip(batches, seconds):
    print(f"| {R} | " + " | ".join(f"{s * 1e3:.1f}" for s in row) + " |")
  print()

  # --- 2. acceptance, calibration, scheduler --------------------------------------------------
  R = args.requests
  groups = [P[i * R:(i + 1) * R] for i in range(args.prompts)]
  want = [w for g in groups for w in dec.generate(g, args.new_tokens, max_len=limit, temperature=0)]
  tau = curve.at(R)
  results = {}
  for k in list(range(1, K + 1)) + ["scheduled"]:
    st = SpeculativeStats()
    if k == "scheduled":
      spec.curve = curve
    got = [o for g in groups for o in spec.generate(
        g, args.new_tokens, max_len=limit, temperature=0,
        verify_length=None if k == "scheduled" else k, stats=st)]
    spec.curve = None
    same = sum(int(np.array_equal(g, w)) for g, w in zip(got, want))
    expected = st.tokens / sum(tau[kk] for kk in st.lengths)
    results[k] = (st, same, expected, st.tokens / sum(st.seconds))
    log(f"k={k}: {st.mean_accepted:.2f} accepted per round, {st.passes_per_token:.3f} passes/token")
  print(f"Greedy speculative decoding, {args.prompts * R} held-out prompts of {args.prompt_len} "
        f"tokens ({R} in flight), {args.new_tokens} new tokens each (plain decoding: 1 backbone pass per token):\n")
  print(md_header("k", "mean accepted drafts / round", "tokens / round", "backbone passes / token",
                  "= plain greedy (requests)", "expected tokens/s (curve)", "measured tokens/s"))
  for k, (st, same, exp_rate, meas) in results.items():
    print(f"| {k} | {st.mean_accepted:.2f} | {st.tokens / st.rounds:.2f} | "
          f"{st.passes_per_token:.3f} | {same}/{len(want)} | {exp_rate:.1f} | {meas:.1f} |")
  best_fixed = max((v[2], k) for k, v in results.items() if k != "scheduled")
  sched = results["scheduled"]
  ks = np.bincount(sched[0].lengths, minlength=K + 1)
  print(f"\nScheduler: k chosen per round {dict(enumerate(ks.tolist()))}; expected "
        f"{sched[2]:.1f} tokens/s vs {best_fixed[0]:.1f} at the best fixed k = {best_fixed[1]} "
        f"({sched[2] / best_fixed[0] - 1:+.1%}) and {results[K][2]:.1f} at k = K "
        f"({sched[2] / results[K][2] - 1:+.1%}).\n")

  cal = np.asarray(results[K][0].calibration, np.float64)            # (i, c, accepted)
  print(f"Confidence calibration at k = {K} ({len(cal)} verified drafts): per position\n")
  print(md_header("position i", "drafts", "mean predicted c_i", "realised acceptance"))
  for i in range(1, K + 1):
    m = cal[:, 0] == i
    if m.any():
      print(f"| {i} | {int(m.sum())} | {cal[m, 1].mean():.3f} | {cal[m, 2].mean():.3f} |")
  print("\nper confidence bin (all positions):\n")
  print(md_header("c_i bin", "drafts", "mean predicted", "realised acceptance"))
  edges = np.linspace(0, 1, 6)
  for lo, hi in zip(edges[:-1], edges[1:]):
    m = (cal[:, 1] >= lo) & ((cal[:, 1] < hi) | (hi == 1.0))
    if m.any():
      print(f"| [{lo:.1f}, {hi:.1f}) | {int(m.sum())} | {cal[m, 1].mean():.3f} | "
            f"{cal[m, 2].mean():.3f} |")
  ece = sum(abs(cal[m, 1].mean() - cal[m, 2].mean()) * m.sum() for lo, hi in zip(edges[:-1], edges[1:])
            if (m := (cal[:, 1] >= lo) & ((cal[:, 1] < hi) | (hi == 1.0))).any()) / len(cal)
  print(f"\nexpected calibration error (5 bins): {ece:.3f}")


if __name__ == "__main__":
  main()
