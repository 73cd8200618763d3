"""Where a config's train step spends its GPU time, by source: one command (issue 28).

  PYTHONUNBUFFERED=1 python benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 [--top 30]
      [--grad_accum K]
      [--out DIR] [--json PATH] [--set model.remat=false model.ops.hc_site=reference ...]

Runs `benchmarks/gpu_step.py`'s step for the size (`bench`: the real train step, compiled ahead of
time, timed over `--steps`), profiles two more steps, and attributes every GPU kernel to its
source. CUDA command buffers are turned off (`--xla_gpu_enable_command_buffer=`), so each kernel
event names its XLA instruction (`hlo_op`); the compiled HLO text's metadata gives that
instruction's `stack_frame_id`, and the text's FileNames / FunctionNames / FileLocations /
StackFrames tables give the frame's file, function and line (or `source_file` / `source_line`
where the metadata carries them). An instruction XLA made with no source of its own (a fusion with
empty metadata, a copy it inserted around a loop carry or a custom call) is charged to its fused
root's source, else to its first operand's, else to the loop's or conditional's that runs it; an
event that names no instruction of the program
keeps its kernel name in the line table. Printed, kernel time per step (the trace holds two steps):

  - by component (optimizer, attention, indexer, mHC, MoE, Engram, vision, dense, norms, loss,
    other; vision only with `--images`: the model keeps its ViT and the batch is the data
    pipeline's, images and all, as `launch.train` runs it),
    from the innermost frame inside this repository (`COMPONENTS`: file and function rules; a
    custom VJP's operations carry the frame of the line that calls it, so `dsv41_jax/block.py`
    calls into each layer from a function named for it, which the rules know);
  - by work kind (GEMMs, the project's kernels, sorts, scatters, gathers, fills, copies, stack
    writes, concatenates, reductions, elementwise, collectives: `work_kind`, from XLA's names);
  - by source file, by function, and by (op kind, file:line), the top `--top` rows each.

Kernel time is the sum of kernel durations on the GPU streams; it can exceed the step when streams
overlap and falls short of it by the gaps (the "busy" line). Without a GPU: one line, exit 2.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys

_FLAG = "--xla_gpu_enable_command_buffer="
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# Component of a kernel: the first rule matching the innermost in-repository frame's file and
# function (prefix of the repository-relative path; function substring or None for any).
COMPONENTS: tuple[tuple[str, str, str | None], ...] = (
    ("optimizer", "optim/", None),
    ("indexer", "dsv41_jax/layers/indexer.py", None),
    ("indexer", "pallas_kernels/indexer.py", None),
    ("indexer", "pallas_kernels/ops/indexer.py", None),
    ("indexer", "pallas_kernels/topk_select.py", None),
    ("indexer", "pallas_kernels/topk_triton.py", None),
    ("attention", "pallas_kernels/ops/sparse_attention.py", None),
    ("attention", "pallas_kernels/sparse_attention.py", None),
    ("attention", "pallas_kernels/csa2_attention.py", None),
    ("attention", "dsv41_jax/layers/attention.py", None),
    ("attention", "dsv41_jax/layers/compressor.py", None),
    ("attention", "dsv41_jax/layers/rope.py", None),
    ("mHC", "dsv41_jax/layers/mhc.py", None),
    ("mHC", "pallas_kernels/mhc", None),
    ("mHC", "pallas_kernels/ops/mhc.py", None),
    ("MoE", "dsv41_jax/layers/moe", None),
    ("MoE", "pallas_kernels/grouped_matmul.py", None),
    ("MoE", "pallas_kernels/ops/grouped_matmul.py", None),
    ("vision", "dsv41_jax/vision/", None),     # ViT, projector, merge (`--images` batches)
    ("Engram", "dsv41_jax/engram/", None),
    ("Engram", "dsv41_jax/layers/engram.py", None),
    ("norms", "dsv41_jax/layers/norm.py", None),
    ("norms", "pallas_kernels/ops/norm.py", None),
    ("loss", "dsv41_jax/loss.py", None),
    # block.py's calls into the layers, by function: a custom VJP's operations (mhc.expand,
    # collapse, the attention op) carry the frame of the line that calls it, not their own
    # (tests/benchmarks/test_gpu_profile.py holds block.py's calls to these functions).
    ("mHC", "dsv41_jax/block.py", "site_"),    # site_coefficients, site_input, site_output
    ("mHC", "dsv41_jax/block.py", "next_site"),
    ("attention", "dsv41_jax/block.py", "attend"),
    ("indexer", "dsv41_jax/block.py", "indexer_loss"),
    ("indexer", "dsv41_jax/block.py", "publish"),   # the CSA2 step: selection (+ compressor)
    ("dense", "dsv41_jax/model.py", None),     # embedding, head
    ("dense", "dsv41_jax/block.py", None),
    ("dense", "launch/step.py", None),         # the finite-step select, metrics
)
# Issue 26's measure: the ~480 ms it started from were the attention op's masked XLA form
# (`_attend_blocks`: window, selected entries and sink, forward and backward) and the indexer, not
# the attention layer's projections, RoPE or compressor, which the "attention" component also
# holds. These rules pick the op (its kernels, its slot plan and the selection's visibility, the
# custom VJP's frame in block.py) out of that component; the indexer component is added whole.
ATTENTION_OP: tuple[tuple[str, str | None], ...] = (
    ("pallas_kernels/csa2_attention.py", None),
    ("pallas_kernels/sparse_attention.py", None),
    ("pallas_kernels/ops/sparse_attention.py", None),
    ("dsv41_jax/layers/attention.py", "visible_topk"),
    ("dsv41_jax/block.py", "attend"),
)
COMPONENT_ORDER = ("optimizer", "attention", "indexer", "mHC", "MoE", "Engram", "vision", "dense",
                   "norms", "loss", "other")

# `name = shape op(...)`, the shape a tuple `(f32[..]{..}, s8[..]{0})` for cuBLAS GEMMs and sorts
# (read with its `/*index=5*/` comments removed).
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\([^=]*?\)|\S+)\s+([\w\-]+)\((.*)$")
_COMMENT = re.compile(r"/\*[^*]*\*/")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{$")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")


class HloSources:
  """Instruction name → (op kind, op_name, metadata fields) and its source frames, read from a
  compiled HLO text (`compiled.as_text()`).

  The StackFrames table prints each frame's `parent_frame_id` one above its parent's row (the
  outermost frame's reads its own row; jax 0.10.2 and 0.11.2 alike): a table where some frame
  names itself as its parent is read that way. An instruction XLA made without a source (a fusion
  whose own metadata is empty, a copy it inserted) takes its fused root's source, else its first
  operand's, else that of the loop or conditional whose body or branch holds it, so its time is
  charged to the code it serves."""

  def __init__(self, text: str):
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    section, comp = None, None
    self.ops: dict[str, tuple[str, str, dict[str, str]]] = {}
    self.text: dict[str, str] = {}                                # op -> its line, metadata cut
    self.targets: dict[str, str] = {}                             # custom call -> its target
    self._links: dict[str, tuple[str | None, str | None]] = {}   # op -> (first operand, calls)
    self._roots: dict[str, str] = {}                              # computation -> its root op
    self._comp_of: dict[str, str] = {}                            # op -> its computation
    self._caller: dict[str, str] = {}             # computation -> an op that runs or fuses it
    for line in text.splitlines():
      if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        section = line
        continue
      if section and (m := _TABLE_ROW.match(line)):
        tables[section][int(m.group(1))] = m.group(2)
        continue
      section = None
      if not line.startswith(" ") and (m := _COMPUTATION.match(line)):
        comp = m.group(1)
        continue
      if not (m := _INSTR.match(_COMMENT.sub("", line))):
        continue
      root, name, kind, rest = m.groups()
      meta = re.search(r"metadata=\{([^}]*)\}", rest)
      fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', meta.group(1))) if meta else {}
      self.ops[name] = (kind, fields.get("op_name", '""').strip('"'), fields)
      if target := re.search(r'custom_call_target="([^"]*)"', rest):
        self.targets[name] = target.group(1)
      self.text[name] = re.sub(r",?\s*metadata=\{[^}]*\}", "", line.strip())[:240]
      first = re.match(r"\s*%([\w.\-]+)", rest)
      calls = re.search(r"\bcalls=%([\w.\-]+)", rest)
      self._links[name] = (first and first.group(1), calls and calls.group(1))
      self._comp_of[name] = comp
      for called in re.findall(r"(?:\bbody|_computations?|calls|to_apply)=\{?%([\w.\-]+)", rest):
        self._caller.setdefault(called, name)
      for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
        for called in re.findall(r"%([\w.\-]+)", group):
          self._caller.setdefault(called, name)
      if root:
        self._roots[comp] = name
    self._files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    self._funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    self._locs = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in tables["FileLocations"].items()}
    self._frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in tables["StackFrames"].items()}
    self._parent_shift = int(any(int(f.get("parent_frame_id", 0)) == k
                                 for k, f in self._frames.items()))

  def own_frames(self, op: str) -> list[tuple[str, str, int]]:
    """The frames of `op`'s own metadata, innermost first (empty when it has none)."""
    kind, _, fields = self.ops.get(op, ("", "", {}))
    if "source_file" in fields:
      return [(fields["source_file"].strip('"'), "?", int(fields.get("source_line", 0)))]
    out, frame, seen = [], int(fields.get("stack_frame_id", 0)), set()
    while frame and frame not in seen and frame in self._frames:
      seen.add(frame)
      loc = self._locs.get(int(self._frames[frame]["file_location_id"]), {})
      out.append((self._files.get(int(loc.get("file_name_id", 0)), "?"),
                  self._funcs.get(int(loc.get("function_name_id", 0)), "?"),
                  int(loc.get("line", 0))))
      frame = int(self._frames[frame].get("parent_frame_id", 0)) - self._parent_shift
    return out

  def frames(self, op: str, _seen: set | None = None) -> list[tuple[str, str, int]]:
    """`op`'s source frames, innermost first; for an op without its own, its fused root's, else
    its first operand's, else that of the instruction that runs its computation (a loop, a
    conditional: class docstring)."""
    seen = set() if _seen is None else _seen
    if op in seen or op not in self._links or len(seen) > 64:
      return []
    seen.add(op)
    if out := self.own_frames(op):
      return out
    first, calls = self._links[op]
    for nxt in (self._roots.get(calls), first, self._caller.get(self._comp_of.get(op))):
      if nxt and (out := self.frames(nxt, seen)):
        return out
    return []

  def kind(self, op: str) -> str:
    return self.ops.get(op, ("?",))[0]


def repo_frame(frames: list[tuple[str, str, int]]) -> tuple[str, str, int] | None:
  """The innermost frame inside this repository outside benchmarks/ (path relative to it)."""
  for path, fn, line in frames:
    rel = path[len(_REPO):] if path.startswith(_REPO) else None
    if rel is not None and not rel.startswith("benchmarks/"):
      return rel, fn, line
  return None


# What a kernel's instruction does, read from XLA's names for what it emits (a fusion is named by
# its kind and root: `loop_broadcast_fusion`, `input_reduce_fusion`, `gemm_fusion_dot`) and from a
# custom call's target. Fills, copies and stack writes are the traffic of a program's structure
# (a scan's zero-initialised outputs, carries, layouts) rather than of its math.
WORK_KINDS = ("GEMM", "kernels (Pallas, Mosaic)", "sort", "scatter", "gather", "fills",
              "copies, transposes", "stack writes", "concatenates", "reductions", "elementwise",
              "collectives", "other")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def work_kind(hlo: HloSources, op: str) -> str:
  """`op`'s row of WORK_KINDS (the rules in order: the first that matches); an instruction the
  text does not hold (one inside a nested program) is read by its name alone."""
  kind, target = hlo.kind(op), hlo.targets.get(op, "")
  name = re.sub(r"[.\d]+$", "", op)
  if "cublas" in target or "gemm" in target or name.startswith(("gemm_fusion", "cublas")):
    return "GEMM"
  if "triton" in target or "mosaic" in target or name.startswith(("pallas_call", "mpmd_map")):
    return "kernels (Pallas, Mosaic)"
  rules = (("collectives", kind.startswith(_COLLECTIVES) or name.startswith(_COLLECTIVES)),
           ("sort", "sort" in target or kind == "sort" or "sort" in name),
           ("scatter", kind == "scatter" or "scatter" in name),
           ("gather", kind == "gather" or "gather" in name),
           ("fills", kind == "broadcast" or "broadcast_fusion" in name),
           ("copies, transposes", kind in ("copy", "transpose") or "transpose" in name
            or name.startswith("copy")),
           ("stack writes", kind == "dynamic-update-slice" or "dynamic_update_slice" in name),
           ("concatenates", kind == "concatenate" or "concatenate" in name),
           ("reductions", kind == "reduce" or name.startswith(("input_", "triton_softmax"))
            or "reduce" in name),
           ("elementwise", kind in ("fusion", "add", "multiply", "convert", "select")
            or name.startswith(("loop_", "wrapped_"))))
  return next((row for row, hit in rules if hit), "other")


def component(frame: tuple[str, str, int] | None) -> str:
  if frame is None:
    return "other"
  path, fn, _ = frame
  for name, prefix, fn_part in COMPONENTS:
    if path.startswith(prefix) and (fn_part is None or fn_part in fn):
      return name
  return "other"


def gpu_kernels(trace: dict) -> tuple[list[dict], float]:
  """The GPU streams' kernel events and the union of their busy time (µs)."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in procs.items() if "/device:GPU" in n}
  spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
  iv = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in spans)
  busy, end = 0.0, -1.0
  for a, b in iv:
    if b > end:
      busy += b - max(a, end)
      end = b
  return spans, busy


def attribute(spans: list[dict], hlo: HloSources, steps: int) -> dict[str, collections.Counter]:
  """Kernel ms per step, grouped four ways, and per instruction ("op"); "line_n" and "op_n" count
  the kernels per step."""
  groups = {k: collections.Counter()
            for k in ("component", "work", "file", "function", "line", "line_n", "op", "op_n")}
  for e in spans:
    op = str(e.get("args", {}).get("hlo_op", "")).lstrip("%")
    frame = repo_frame(hlo.frames(op))
    ms = e.get("dur", 0) / 1e3 / steps
    groups["component"][component(frame)] += ms
    groups["work"][work_kind(hlo, op) if op else "other"] += ms
    where = frame or ("(no source)", "?", 0)
    groups["file"][where[0]] += ms
    groups["function"][f"{where[0]}:{where[1]}"] += ms
    if op in hlo.ops:
      line = f"{hlo.kind(op)} {where[0]}:{where[2]} ({where[1]})"
    else:   # an event that names no instruction of the program: keep the kernel's name
      line = f"? {str(e.get('name', ''))[:60]} (hlo_op {op!r})"
    groups["line"][line] += ms
    groups["line_n"][line] += 1 / steps
    groups["op"][op] += ms
    groups["op_n"][op] += 1 / steps
  return groups


def kernel_sizes(spans: list[dict], steps: int) -> str:
  """Kernels per step and how much of their time is in short ones (launch-bound work: a step's
  fixed cost that does not shrink with fewer rows)."""
  durs = [e.get("dur", 0) for e in spans]
  parts = [f"{len(durs) / steps:,.0f} kernels per step"]
  for lim in (5, 10, 50):
    short = [d for d in durs if d < lim]
    parts.append(f"{len(short) / steps:,.0f} under {lim} µs ({sum(short) / 1e3 / steps:.1f} ms)")
  return "; ".join(parts)


def report_ops(groups: dict[str, collections.Counter], hlo: HloSources, top: int) -> str:
  """The `top` single instructions by kernel time: ms and kernels per step, source, HLO text."""
  lines = [f"top {top} instructions (ms per step, kernels per step, source, HLO):"]
  for op, ms in groups["op"].most_common(top):
    where = repo_frame(hlo.frames(op)) or ("(no source)", "?", 0)
    lines.append(f"  {ms:8.2f}  {groups['op_n'][op]:6.0f}  {where[0]}:{where[2]}  "
                 f"{hlo.text.get(op, op)}")
  return "\n".join(lines)


def report(groups: dict[str, collections.Counter], step_ms: float, busy_ms: float,
           top: int) -> str:
  total = sum(groups["component"].values())
  lines = [f"step {step_ms:.1f} ms; kernel time {total:.1f} ms per step; GPU busy "
           f"{busy_ms:.1f} ms per step", "",
           "| component | ms per step | share of kernel time | share of step |", "|---|---|---|---|"]
  for name in COMPONENT_ORDER:
    ms = groups["component"].get(name, 0.0)
    lines.append(f"| {name} | {ms:.1f} | {ms / max(total, 1e-9):.1%} | {ms / step_ms:.1%} |")
  lines += [""] + issue_lines(groups["component"], groups["line"])
  lines += ["", "| work kind | ms per step | share of kernel time |", "|---|---|---|"]
  for name in WORK_KINDS:
    if ms := groups["work"].get(name, 0.0):
      lines.append(f"| {name} | {ms:.1f} | {ms / max(total, 1e-9):.1%} |")
  for key, title in (("file", "source file"), ("function", "function"),
                     ("line", "op kind, file:line")):
    per = " and kernels" if key == "line" else ""
    lines += ["", f"top {top} by {title} (ms{per} per step):"]
    for name, ms in groups[key].most_common(top):
      n = f"  {groups['line_n'][name]:6.0f}" if key == "line" else ""
      lines.append(f"  {ms:8.2f}  {ms / max(total, 1e-9):6.1%}{n}  {name}")
  return "\n".join(lines)


_LINE_KEY = re.compile(r"^\S+ (\S+?):(\d+) \((.*)\)$")


def recomponent(line_ms: dict[str, float], renames: dict[str, str] | None = None
                ) -> collections.Counter:
  """Component ms from a stored profile's (op kind, file:line) totals under today's `COMPONENTS`.
  `renames` {"file:line": function} gives a line the function its code sits in now (a stored
  profile names the function of its own commit). Lines without a source go to "other"."""
  out = collections.Counter()
  for key, ms in line_ms.items():
    m = _LINE_KEY.match(key)
    if not m or m.group(1) == "?":
      out["other"] += ms
      continue
    path, line, fn = m.group(1), int(m.group(2)), m.group(3)
    out[component((path, (renames or {}).get(f"{path}:{line}", fn), line))] += ms
  return out


def attention_op_ms(line_ms: dict[str, float], renames: dict[str, str] | None = None) -> float:
  """ms of the (op kind, file:line) totals that `ATTENTION_OP` picks out (issue 26's measure,
  with the indexer component beside it)."""
  total = 0.0
  for key, ms in line_ms.items():
    if not (m := _LINE_KEY.match(key)):
      continue
    path, fn = m.group(1), (renames or {}).get(f"{m.group(1)}:{m.group(2)}", m.group(3))
    if any(path.startswith(f) and (want is None or want in fn) for f, want in ATTENTION_OP):
      total += ms
  return total


def issue_lines(component_ms: dict[str, float], line_ms: dict[str, float],
                renames: dict[str, str] | None = None) -> list[str]:
  """The issues' measures from a step's tables (issue 26: the attention op and the indexer;
  issue 27: mHC and MoE), one line each."""
  op = attention_op_ms(line_ms, renames)
  idx, att = component_ms.get("indexer", 0.0), component_ms.get("attention", 0.0)
  return [f"issue 26: attention op + indexer {op + idx:.1f} ms (op {op:.1f}, indexer {idx:.1f}; "
          f"the attention component's other {att - op:.1f} ms are projections, RoPE, compressor)",
          f"issue 27: mHC {component_ms.get('mHC', 0.0):.1f} ms, MoE "
          f"{component_ms.get('MoE', 0.0):.1f} ms"]


def reread(path: str, renames: dict[str, str] | None = None) -> str:
  """The tables of a stored profile (`--json`): the component table recomputed from its
  (op kind, file:line) totals with today's rules (`recomponent`), beside the one it stored; and the
  work kinds of its instructions' HLO lines read back as a program, shares of the whole step's
  kernel time."""
  with open(path) as f:
    d = json.load(f)
  lines = []
  if "line" in d["groups"]:
    now, then = recomponent(d["groups"]["line"], renames), d["groups"]["component"]
    lines += ["| component | stored ms | ms by today's rules |", "|---|---:|---:|"]
    lines += [f"| {k} | {then.get(k, 0.0):.1f} | {now[k]:.1f} |" for k in COMPONENT_ORDER]
    lines += [""] + issue_lines(now, d["groups"]["line"], renames) + [""]
  hlo = HloSources("ENTRY %stored {\n" + "\n".join(
      "  " + v["text"] for v in d["ops"].values() if v["text"]) + "\n}\n")
  work = collections.Counter()
  for op, v in d["ops"].items():
    work[work_kind(hlo, op)] += v["ms"]
  total = sum(d["groups"]["component"].values())
  lines += [f"{path}: {sum(work.values()):.1f} of {total:.1f} ms of kernel time a step in its "
            f"{len(d['ops'])} stored instructions", "| work kind | ms | share |", "|---|---:|---:|"]
  lines += [f"| {k} | {work[k]:.1f} | {work[k] / total:.1%} |" for k in WORK_KINDS if work[k]]
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="s3", help="a size of configs/small.py (optionally /noremat)")
  ap.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
  ap.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step")
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--steps", type=int, default=3, help="timed steps before the two profiled ones")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--out", default="/tmp/dsv41_profile", help="trace and HLO text directory")
  ap.add_argument("--json", default=None, help="write the groups and step figures here")
  ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                  help="config keys, e.g. model.ops.hc_site=reference (gpu_step.bench)")
  ap.add_argument("--images", action="store_true",
                  help="the model with its ViT on the data pipeline's first batch (gpu_step.bench)")
  ap.add_argument("--train_vit", action="store_true",
                  help="with --images: the ViT-trainable program (else the frozen one)")
  ap.add_argument("--reread", default=None, metavar="JSON",
                  help="print a stored --json profile's component table by today's rules and "
                       "its work-kind table (its 500 largest instructions) and exit; no GPU needed")
  ap.add_argument("--rename", nargs="*", default=[], metavar="FILE:LINE=FUNCTION",
                  help="with --reread: the function a stored line's code sits in now")
  args = ap.parse_args(argv)
  if args.reread:
    renames = dict(r.rsplit("=", 1) for r in args.rename)
    print(reread(args.reread, renames))
    return 0

  import jax
  if jax.default_backend() != "gpu":
    print(f"error: gpu_profile needs a GPU; jax's backend here is {jax.default_backend()!r}")
    return 2
  from benchmarks import gpu_step
  from benchmarks.common import header
  out = gpu_step.bench(args.size, args.batch, args.seq, args.steps, False, args.out,
                       accum=args.grad_accum, overrides=tuple(args.set), images=args.images,
                       train_vit=args.train_vit)
  name = args.size.replace("/", "_")
  with open(os.path.join(args.out, name + ".hlo.txt")) as f:
    hlo = HloSources(f.read())
  traces = sorted(glob.glob(os.path.join(args.out, name, "**", "perfetto_trace.json.gz"),
                            recursive=True), key=os.path.getmtime)
  from benchmarks.trace_summary import load
  spans, busy = gpu_kernels(load(traces[-1]))
  groups = attribute(spans, hlo, steps=2)
  print("\n" + header())
  micro = f"{args.grad_accum} × " if args.grad_accum > 1 else ""
  print(f"{args.size} at {micro}{args.batch} × {args.seq}: MFU {out['mfu']:.1%}, "
        f"{out['tokens_per_s']:,.0f} tok/s, compile {out['compile_s']:.1f} s")
  print(kernel_sizes(spans, steps=2))
  print(report(groups, out["step_s"] * 1e3, busy / 1e3 / 2, args.top))
  print("\n" + report_ops(groups, hlo, args.top))
  if args.json:
    with open(args.json, "w") as f:
      ops = {op: dict(ms=ms, n=groups["op_n"][op], text=hlo.text.get(op, ""),
                      source=repo_frame(hlo.frames(op))) for op, ms in groups["op"].most_common(500)}
      json.dump(dict(bench=out, groups={k: dict(v) for k, v in groups.items()
                                          if k not in ("op", "op_n")},
                     ops=ops), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
