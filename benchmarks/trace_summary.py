"""Summarise a jax profiler trace (`perfetto_trace.json.gz`, written by
`jax.profiler.trace(..., create_perfetto_trace=True)`, e.g. `benchmarks/gpu_step.py --profile DIR`):
GPU kernels by total time, their count, and how much of the traced wall time a GPU stream was busy.

  python benchmarks/trace_summary.py DIR [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def load(path: str) -> dict:
  with gzip.open(path, "rt") as f:
    return json.load(f)


def summarise(trace: dict, top: int) -> str:
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {}
  for e in events:  # process / thread names tell device streams from host threads
    if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
      names[(e.get("pid"), e.get("tid") if e["name"] == "thread_name" else None)] = \
          e["args"]["name"]
  dev_pids = {pid for (pid, tid), n in names.items() if tid is None and "/device:GPU" in n}
  spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in dev_pids]
  if not spans:
    return "no GPU events found; processes: " + ", ".join(sorted(set(names.values())))[:2000]
  by_stream: dict = collections.defaultdict(list)
  for e in spans:
    by_stream[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e.get("dur", 0)))
  t0 = min(e["ts"] for e in spans)
  t1 = max(e["ts"] + e.get("dur", 0) for e in spans)
  lines = [f"traced GPU span {(t1 - t0) / 1e3:.1f} ms, {len(spans)} device events"]
  for key, iv in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
    iv.sort()
    busy, end = 0.0, -1.0
    for a, b in iv:  # union of intervals
      if b > end:
        busy += b - max(a, end)
        end = b
    lines.append(f"  stream {names.get(key, key)}: {len(iv)} events, busy {busy / 1e3:.1f} ms "
                 f"({busy / max(t1 - t0, 1):.0%} of the span)")
  tot = collections.Counter()
  cnt = collections.Counter()
  for e in spans:
    tot[e["name"]] += e.get("dur", 0)
    cnt[e["name"]] += 1
  allt = sum(tot.values())
  lines.append(f"top {top} of {len(tot)} kernel names by total time (all streams, {allt / 1e3:.1f} ms):")
  for n, t in tot.most_common(top):
    lines.append(f"  {t / 1e3:8.2f} ms {t / allt:6.1%} ×{cnt[n]:6d} {t / cnt[n]:8.1f} µs  {n[:90]}")
  short = sum(1 for e in spans if e.get("dur", 0) < 10)
  lines.append(f"events under 10 µs: {short} ({short / len(spans):.0%})")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("dir")
  ap.add_argument("--top", type=int, default=25)
  args = ap.parse_args()
  for path in sorted(glob.glob(os.path.join(args.dir, "**", "perfetto_trace.json.gz"),
                               recursive=True)):
    print(f"== {path}")
    print(summarise(load(path), args.top))


if __name__ == "__main__":
  main()
