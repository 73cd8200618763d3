"""Bytes each kernel of a compiled HLO program moves per step, by op kind and source line (issue 28).

  python benchmarks/hlo_traffic.py /tmp/dsv41_profile/m3.hlo.txt [--top 30] [--tbps 3 4.1]
      [--kinds copy fusion] [--unsourced] [--branch cond.257=0.25,0.75 ...] [--repo /work/main]

Reads the text `gpu_profile.py` writes (`compiled.as_text()`), with no GPU. A kernel is an
instruction of a computation that runs as code (the entry, while bodies, conditional branches)
other than parameters, constants, tuples, bitcasts and control flow. Its bytes are its output plus
what it reads of each operand: a fused parameter read only through (dynamic-)slices or gathers
counts what they keep, a dynamic-update-slice root writes its update, not its buffer. Executions
per step: a while body runs its `known_trip_count` times (1 where XLA knows none: such loops are
flagged), a conditional's branches equally often unless `--branch NAME=w0,w1,...` gives their
shares in XLA's branch order (true, false for a predicate) (NAME a conditional instruction, or a
number of branches for every conditional with that many; a layer scan's kind switch runs each kind's branch for that kind's share of the run's
layers). Sources are `gpu_profile.HloSources`' (an instruction XLA made is charged to the code it
serves, marked `*`); `--unsourced` keeps only the instructions with no metadata source of their own
(what the profile showed as "(no source)" before that rule). Time is bytes over bandwidth: a
streaming kernel on the H200 reaches ~4.1 TB/s (benchmarks/RESULTS.md, m3's no-source kernels).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpu_profile  # noqa: E402

_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, f16=2, bf16=2, s32=4, u32=4, f32=4, s64=8, u64=8,
              f64=8, f8e4m3fn=1, f8e5m2=1, c64=8)
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
              "conditional", "call", "fusion-done", "copy-done", "after-all", "opt-barrier",
              "add-dependency", "async-done", "partition-id", "replica-id"}


def nbytes(shape: str) -> int:
  """Bytes of a shape string, summed over a tuple's arrays."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


class Instr:
  def __init__(self, name, shape, op, operands, attrs, root):
    self.name, self.shape, self.op, self.operands, self.attrs, self.root = (
        name, shape, op, operands, attrs, root)


def _group_end(s: str, i: int) -> int:
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j + 1
  return len(s)


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
  """Computation name → its instructions, and the entry computation's name."""
  comps: dict[str, list[Instr]] = {}
  entry = cur = None
  for line in text.splitlines():
    if not line.startswith(" ") and (m := _HEADER.match(line)):
      cur = m.group(2)
      comps[cur] = []
      entry = cur if m.group(1) else entry
      continue
    if cur is None or not (m := _INSTR.match(line)):
      cur = None if line.startswith("}") else cur
      continue
    i = m.end()
    j = _group_end(line, i) if line[i] == "(" else line.index(" ", i)
    rest = line[j:].lstrip()
    k = rest.index("(")
    e = _group_end(rest, k)
    comps[cur].append(Instr(m.group(2), line[i:j], rest[:k], re.findall(r"%([\w.\-]+)", rest[k:e]),
                            rest[e:], bool(m.group(1))))
  return comps, entry


def _called(ins: Instr) -> list[tuple[str, str, int | None]]:
  """(computation, role, trip count) this instruction runs as code."""
  if ins.op == "while":
    trip = _TRIP.search(ins.attrs)
    body = re.search(r"\bbody=%([\w.\-]+)", ins.attrs).group(1)
    return [(body, "body", int(trip.group(1)) if trip else None)]
  if ins.op == "conditional":
    m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
    names = (re.findall(r"%([\w.\-]+)", m.group(1)) if m else
             [re.search(rf"{k}_computation=%([\w.\-]+)", ins.attrs).group(1)
              for k in ("true", "false")])      # XLA's branch order for a predicate
    return [(n, "branch", None) for n in names]
  return []


def executions(comps, entry, branch: dict[str, list[float]]) -> tuple[dict[str, float], set[str]]:
  """Runs per step of each code computation; the while bodies whose trip count XLA does not know."""
  runs, unknown = {entry: 1.0}, set()

  def walk(c):
    for ins in comps[c]:
      called = _called(ins)
      if not called:
        continue
      shares = branch.get(ins.name, branch.get(str(len(called)), [1 / len(called)] * len(called)))
      for (sub, role, trip), share in zip(called, shares):
        if role == "body" and trip is None:
          unknown.add(sub)
        runs[sub] = runs.get(sub, 0.0) + runs[c] * (share if role == "branch" else (trip or 1))
        walk(sub)

  walk(entry)
  return runs, unknown


def kernel_bytes(comps, ins: Instr, shapes: dict[str, str]) -> int:
  """Output plus what is read of each operand (module docstring)."""
  out = nbytes(ins.shape)
  calls = re.search(r"\bcalls=%([\w.\-]+)", ins.attrs)
  if ins.op not in ("fusion", "fusion-start") or not calls:
    return out + sum(nbytes(shapes.get(o, "")) for o in ins.operands)
  body = comps[calls.group(1)]
  by_name = {x.name: x for x in body}
  users = collections.defaultdict(list)
  for x in body:
    for o in x.operands:
      users[o].append(x)
  root = next(x for x in body if x.root)
  roots = [by_name[o] for o in root.operands] if root.op == "tuple" else [root]
  in_place = set()
  for r in roots:
    if r.op == "dynamic-update-slice":
      out -= nbytes(r.shape) - nbytes(by_name[r.operands[1]].shape)
      in_place.add(r.operands[0])
  need = {}       # fraction of each fused value that is read, from its users back to the parameters
  for x in reversed(body):
    if x in roots:
      need[x.name] = 1.0
      continue
    total = 0.0
    for u in users[x.name]:
      if u.op in ("slice", "dynamic-slice", "gather") and u.operands[0] == x.name:
        total += need.get(u.name, 1.0) * nbytes(u.shape) / max(nbytes(x.shape), 1)
      elif not (u.op == "dynamic-update-slice" and u.operands[0] == x.name and x.name in in_place):
        total += need.get(u.name, 1.0)
    need[x.name] = min(1.0, total)
  return out + int(sum(need[x.name] * nbytes(x.shape) for x in body if x.op == "parameter"))


def traffic(text: str, branch: dict[str, list[float]] | None = None, unsourced: bool = False):
  """[(op kind, source, inferred, instruction, GB per step, executions)] of every kernel."""
  comps, entry = parse(text)
  sources = gpu_profile.HloSources(text)
  runs, unknown = executions(comps, entry, branch or {})
  shapes = {i.name: i.shape for v in comps.values() for i in v}
  rows = []
  for comp, n in runs.items():
    for ins in comps[comp]:
      if ins.op in _NO_KERNEL:
        continue
      own = gpu_profile.repo_frame(sources.own_frames(ins.name))
      if unsourced and own is not None:
        continue
      frame = gpu_profile.repo_frame(sources.frames(ins.name))
      where = f"{frame[0]}:{frame[2]} ({frame[1]})" if frame else "(no source)"
      rows.append((ins.op, where + (" [loop trips unknown]" if comp in unknown else ""),
                   own is None and frame is not None, ins.name,
                   n * kernel_bytes(comps, ins, shapes) / 1e9, n))
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("hlo", help="a compiled HLO text (gpu_profile.py's OUT/SIZE.hlo.txt)")
  ap.add_argument("--top", type=int, default=30)
  ap.add_argument("--tbps", type=float, nargs="*", default=[3.0, 4.1], help="bandwidths, TB/s")
  ap.add_argument("--kinds", nargs="*", default=None, help="only these op kinds (copy, fusion, ...)")
  ap.add_argument("--unsourced", action="store_true",
                  help="only instructions with no source of their own")
  ap.add_argument("--branch", nargs="*", default=[], metavar="COND=W0,W1",
                  help="a conditional's branch shares (default equal)")
  ap.add_argument("--repo", default=gpu_profile._REPO,
                  help="the repository root the program was traced in (default: this one)")
  args = ap.parse_args(argv)
  gpu_profile._REPO = os.path.join(args.repo, "")
  branch = {}
  for item in args.branch:
    name, _, ws = item.partition("=")
    branch[name] = [float(w) for w in ws.split(",")]
  with open(args.hlo) as f:
    rows = traffic(f.read(), branch, args.unsourced)
  if args.kinds:
    rows = [r for r in rows if r[0] in args.kinds]
  groups = collections.defaultdict(lambda: [0.0, 0, ""])
  by_kind = collections.Counter()
  for kind, where, inferred, name, gb, _ in rows:
    g = groups[(kind, where + (" *" if inferred else ""))]
    g[0] += gb
    g[1] += 1
    g[2] = g[2] or name
    by_kind[kind] += gb
  ms = lambda gb: " / ".join(f"{gb / t:.1f}" for t in args.tbps)
  print(f"GB per step and ms at {' / '.join(map(str, args.tbps))} TB/s; * = charged to the code "
        "an XLA-made instruction serves")
  for (kind, where), (gb, n, name) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"  {gb:8.2f} GB  {ms(gb):>13s} ms  {n:4d} × {kind} {where}  (e.g. {name})")
  print("by kind: " + ", ".join(f"{k} {gb:.1f} GB ({ms(gb)} ms)" for k, gb in by_kind.most_common()))
  print(f"all: {sum(by_kind.values()):.1f} GB ({ms(sum(by_kind.values()))} ms)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
