"""Summarise a jax profiler trace (`perfetto_trace.json.gz`, written by
`jax.profiler.trace(..., create_perfetto_trace=True)`, e.g. `benchmarks/gpu_step.py --profile DIR`):
GPU kernels by total time, their count, and how much of the traced wall time a GPU stream was busy.

  python benchmarks/trace_summary.py DIR [--top 25] [--hlo DIR/s1.hlo.txt]   # --hlo: each kernel's source
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")


def hlo_metadata(path: str) -> dict[str, str]:
  """Instruction name -> its metadata (op_name, source file and line) in an HLO text dump
  (`compiled.as_text()`, as `benchmarks/gpu_step.py --profile` writes it)."""
  out = {}
  with open(path) as f:
    for line in f:
      m = _INSTR.match(line)
      if m:
        out[m.group(1)] = m.group(2)
  return out


def load(path: str) -> dict:
  with gzip.open(path, "rt") as f:
    return json.load(f)


def summarise(trace: dict, top: int, show_args: bool = False,
              meta: dict[str, str] | None = None) -> str:
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
  args: dict = {}
  for e in spans:
    tot[e["name"]] += e.get("dur", 0)
    cnt[e["name"]] += 1
    args.setdefault(e["name"], e.get("args", {}))
  allt = sum(tot.values())
  lines.append(f"top {top} of {len(tot)} kernel names by total time (all streams, {allt / 1e3:.1f} ms):")
  for n, t in tot.most_common(top):
    lines.append(f"  {t / 1e3:8.2f} ms {t / allt:6.1%} ×{cnt[n]:6d} {t / cnt[n]:8.1f} µs  {n[:90]}")
    if show_args:  # the XLA op and its source (the profiler's event arguments), to attribute it
      a = {k: v for k, v in args[n].items() if k not in ("correlation_id", "group_id")}
      lines.append(f"      {str(a)[:300]}")
      op = str(a.get("hlo_op", "")).lstrip("%")
      if meta and op in meta:
        lines.append(f"      source: {meta[op][:300]}")
  short = sum(1 for e in spans if e.get("dur", 0) < 10)
  lines.append(f"events under 10 µs: {short} ({short / len(spans):.0%})")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("dir")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--args", action="store_true", help="print each top kernel's event arguments")
  ap.add_argument("--hlo", default=None, help="the program's HLO text: print each top kernel's source")
  args = ap.parse_args()
  for path in sorted(glob.glob(os.path.join(args.dir, "**", "perfetto_trace.json.gz"),
                               recursive=True)):
    print(f"== {path}")
    meta = hlo_metadata(args.hlo) if args.hlo else None
    print(summarise(load(path), args.top, args.args or meta is not None, meta))


if __name__ == "__main__":
  main()
