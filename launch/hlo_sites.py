"""Where a program's serialising and slow-precision ops come from (docs/design.md §T8).

`sites(lowered_text)` reads a jitted function's StableHLO, lowered with debug locations
(`jax.jit(f).lower(...).as_text(debug_info=True)`), and lists every op of the kinds that have cost
this project real GPU time: each scatter (XLA serialises colliding float atomics: the Sinkhorn
`segment_sum` that was a third of the s3 step), each sort and top-k (a full sort per row), and
each `dot_general` on float32 operands above a FLOP threshold (CUDA-core GEMMs instead of tensor
cores). Each op is attributed to the innermost frame of its source location: file (relative to
the repository), function and line. Lowering only traces, so this runs on the CPU in seconds and
says what the GPU will be asked to do; `tests/launch/test_step_program.py` holds the train step
to an allow-list with it.
"""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LOC_DEF = re.compile(r"^#(loc\d*) = (.*)$", re.M)
_CALLSITE = re.compile(r"loc\(callsite\(#(loc\d+) at #(loc\d+)\)\)")
_NAMED = re.compile(r'loc\("((?:[^"\\]|\\.)*)"\(#(loc\d+)\)\)')
_FILE = re.compile(r'loc\("([^"]+)":(\d+)')
_TRAILING_LOC = re.compile(r"loc\(#(loc\d+)\)\s*$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z][a-z0-9]*)>")
_FUNC = re.compile(r"^\s*func\.func (?:private |public )?@([\w.$-]+)\(")
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
_REGION_OPS = {'"stablehlo.scatter"(': "scatter", '"stablehlo.sort"(': "sort"}
# Python 3.12 inlines list, dict and set comprehensions (PEP 709), so 3.11's qualname
# `f.<locals>.<listcomp>.<lambda>` is `f.<locals>.<lambda>` there; sites use the 3.12 spelling.
_COMPREHENSION = re.compile(r"\.<(?:listcomp|dictcomp|setcomp)>")


class Site(NamedTuple):
  """One op: its kind ("scatter", "sort", "top_k", "f32_dot"), where it was written (file relative
  to the repository, the innermost function without comprehension frames, line), and its size (FLOPs for a dot, elements of
  the updates / operand otherwise)."""
  kind: str
  file: str
  function: str
  line: int
  size: float
  op: str   # jax's name stack, e.g. "jit(train_step)/transpose(jvp(btd,dv->btv))/dot_general"

  def where(self) -> str:
    return f"{self.file}:{self.line} ({self.function})"


def _frames(locs: dict[str, str], name: str, out: list) -> list:
  """Flatten a location into [function name | (file, line)] from the innermost frame out."""
  text = locs.get(name, "")
  if m := _CALLSITE.match(text):
    _frames(locs, m.group(1), out)
    _frames(locs, m.group(2), out)
  elif m := _NAMED.match(text):
    out.append(m.group(1))
    _frames(locs, m.group(2), out)
  elif m := _FILE.match(text):
    out.append((m.group(1), int(m.group(2))))
  return out


def _op_name(locs: dict[str, str], line: str) -> str:
  m = _TRAILING_LOC.search(line)
  frames = _frames(locs, m.group(1), []) if m else []
  return frames[0] if frames and isinstance(frames[0], str) else ""


def _origin(locs: dict[str, str], line: str) -> tuple[str, str, int]:
  """(file, function, line) of the op's innermost frame that has a file; ("?", "?", 0) if none."""
  m = _TRAILING_LOC.search(line)
  frames = _frames(locs, m.group(1), []) if m else []
  for i, frame in enumerate(frames):
    if isinstance(frame, tuple):   # a frame is its function's name, then its file location
      named = i and isinstance(frames[i - 1], str)
      function = _COMPREHENSION.sub("", frames[i - 1]) if named else "?"
      path = frame[0]
      return (path[len(_ROOT):] if path.startswith(_ROOT) else path), function, frame[1]
  return "?", "?", 0


def _shapes(signature: str) -> list[tuple[list[int], str]]:
  return [([int(d) for d in dims.split("x") if d], dtype)
          for dims, dtype in _TENSOR.findall(signature)]


def _dot_flops(line: str) -> tuple[float, bool]:
  """(FLOPs, both operands float32) of one `stablehlo.dot_general` line."""
  sig = line[line.rindex(" : (") + 3:]
  (lhs, lt), (rhs, rt), (out, _) = _shapes(sig)[:3]
  m = re.search(r"contracting_dims = \[([\d, ]*)\] x", line)
  contracted = [int(i) for i in m.group(1).split(",") if i.strip()] if m else []
  return 2.0 * math.prod(out) * math.prod(lhs[i] for i in contracted), lt == rt == "f32"


def sites(text: str, *, f32_dot_flops: float = 1e7) -> list[Site]:
  """Every scatter, sort, top-k and float32 `dot_general` above `f32_dot_flops` in `text`.

  An op inside a private function without a source location of its own (jax's `argsort`,
  `cumsum`, ... helpers) is attributed to the function's first call site.
  """
  locs = dict(_LOC_DEF.findall(text))
  lines = text.splitlines()
  callers, function = {}, None   # function → (the function holding its first call, that line)
  for line in lines:
    if m := _FUNC.match(line):
      function = m.group(1)
    for name in _CALL.findall(line):
      callers.setdefault(name, (function, line))
  found, function = [], None

  def origin(line):
    where, inside, seen = _origin(locs, line), function, set()
    while where[0] == "?" and inside in callers and inside not in seen:
      seen.add(inside)
      inside, call = callers[inside]
      where = _origin(locs, call)
    return where

  for i, line in enumerate(lines):
    if m := _FUNC.match(line):
      function = m.group(1)
    kind = next((k for op, k in _REGION_OPS.items() if op in line), None)
    if kind:   # region op: its type and location close the region, at the op's indentation
      indent = len(line) - len(line.lstrip())
      close = next(l for l in lines[i + 1:]
                   if l.startswith(" " * indent + "})") and len(l) - len(l.lstrip()) == indent)
      shapes = _shapes(close[close.index(" : ("):])
      size = math.prod(shapes[2][0] if kind == "scatter" else shapes[0][0])
      found.append(Site(kind, *origin(close), float(size), _op_name(locs, close)))
    elif "chlo.top_k" in line:
      found.append(Site("top_k", *origin(line),
                        float(math.prod(_shapes(line[line.rindex(" : "):])[0][0])),
                        _op_name(locs, line)))
    elif "stablehlo.dot_general" in line:
      flops, f32 = _dot_flops(line)
      if f32 and flops > f32_dot_flops:
        found.append(Site("f32_dot", *origin(line), flops, _op_name(locs, line)))
  return found
