"""Matrix-product FLOPs of a config's train step by source line, read from its jaxpr on the CPU.

  python benchmarks/flop_audit.py --size m3 --batch 1 --seq 4096 [--set KEY=VALUE ...] [--top 40]

Traces (never compiles) the train step `launch.train` builds and walks its jaxpr: every
`dot_general` and `ragged_dot_general` counts 2·M·N·K FLOPs per execution (a ragged product each
row once), multiplied by the trip counts of the `scan`s around it (layers, micro-batches, loss
chunks, Newton–Schulz steps: `fori_loop` with static bounds is a `scan`; a `while` counting to a
constant by that count, any other by 1, listed). `pallas_call`s are listed apart, unopened. Rows are grouped by the innermost frame in
the project's code (file:function:line): the forward, layer remat's recomputed forward, the
backward and the optimizer share a line's row, and "runs" says how often a step executes it, so a
layer's dense product shows 4 runs a layer (forward, remat forward, two backward products).

Read it against the model: the useful FLOPs are `dsv41_jax.flops.train_flops_per_token` (printed),
and a product that runs more often than its place explains is work to take out. Two limits: the
ops run in their CPU forms (the attention and indexer references score every entry, far more
than the GPU kernels; the kernel policies cannot be traced here, their interpret modes carry
callbacks that layer remat refuses), and the jaxpr still holds products whose values nothing
reads (e.g. the primal output of a `jax.vjp` inside a custom backward), which XLA removes: a
row's runs are an upper bound.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _frame(eqn) -> str:
  """file:function:line of the innermost frame inside this repository (else the innermost)."""
  from jax._src import source_info_util
  tb = eqn.source_info.traceback
  frames = list(tb.frames) if tb is not None else []
  for f in frames:
    path = os.path.abspath(f.file_name)
    if (path.startswith(_REPO) and "/benchmarks/" not in path and "site-packages" not in path
        and "/.venv" not in path):
      return f"{os.path.relpath(path, _REPO)}:{f.function_name}:{f.line_num}"
  return source_info_util.summarize(eqn.source_info) if frames else "?"


def _dot_flops(eqn) -> float:
  """2 · (output elements) · (contracted size); a ragged product contracting its ragged rows (the
  weight gradient, [G, ...] out) uses each row once, so its output counts once, not G times."""
  import numpy as np
  lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
  ragged = eqn.primitive.name == "ragged_dot_general"
  dn = eqn.params["ragged_dot_dimension_numbers"] if ragged else None
  (lc, _), _ = dn.dot_dimension_numbers if ragged else eqn.params["dimension_numbers"]
  flops = 2.0 * float(np.prod(out.shape)) * float(np.prod([lhs.shape[i] for i in lc]))
  if ragged and dn.lhs_ragged_dimensions and dn.lhs_ragged_dimensions[0] in lc:
    flops /= out.shape[0]
  return flops


def _while_trips(eqn) -> int | None:
  """The trip count of a `while_loop` counting i from a constant while i < a constant, else None
  (`fori_loop` with static bounds writes a `scan`)."""
  cj = eqn.params["cond_jaxpr"]
  if len(cj.jaxpr.eqns) != 1 or cj.jaxpr.eqns[0].primitive.name != "lt":
    return None
  n_consts = eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]
  inits = eqn.invars[n_consts:]
  try:
    lo = int(inits[0].val)
    hi_var = cj.jaxpr.eqns[0].invars[1]
    if hasattr(hi_var, "val"):
      hi = int(hi_var.val)
    else:
      idx = cj.jaxpr.invars.index(hi_var) - eqn.params["cond_nconsts"]
      hi = int(inits[idx].val)
  except (AttributeError, ValueError, TypeError, IndexError):
    return None
  return max(0, hi - lo)


def walk(jaxpr, mult: float, rows, kernels, unknown_whiles):
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "ragged_dot_general"):
      key = _frame(eqn)
      rows[key][0] += mult * _dot_flops(eqn)
      rows[key][1] += mult
      continue
    if name == "pallas_call":
      kernels[eqn.params.get("name_and_src_info", eqn.params.get("name", "?")).__str__()
              .split(" ")[0]] += mult
      continue
    sub_mult = mult
    if name == "scan":
      sub_mult = mult * eqn.params["length"]
    elif name == "while":
      trips = _while_trips(eqn)
      if trips is None:
        unknown_whiles[_frame(eqn)] += mult
        trips = 1
      sub_mult = mult * trips
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          walk(inner, sub_mult, rows, kernels, unknown_whiles)
        elif hasattr(sub, "eqns"):
          walk(sub, sub_mult, rows, kernels, unknown_whiles)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="m3")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--accum", type=int, default=1)
  ap.add_argument("--top", type=int, default=40)
  ap.add_argument("--set", nargs="*", default=(), metavar="KEY=VALUE")
  args = ap.parse_args(argv)

  import jax
  from benchmarks.zero_fills import _config
  from configs.common import MeshConfig
  from dsv41_jax import flops as flops_lib
  from launch import aot, setup

  cfg = _config(args.size, args.batch, args.seq, args.accum, tuple(args.set))
  mesh = setup.build_mesh(MeshConfig(data=1), jax.devices()[:1])
  low = aot.lower_args(cfg, mesh, args.batch * args.accum)
  with jax.set_mesh(low.mesh):
    closed = jax.make_jaxpr(low.step)(*low.args)
  rows = collections.defaultdict(lambda: [0.0, 0.0])
  kernels, unknown = collections.Counter(), collections.Counter()
  walk(closed.jaxpr, 1.0, rows, kernels, unknown)

  tokens = args.batch * args.accum * args.seq
  useful = flops_lib.train_flops_per_token(low.model_cfg, args.seq) * tokens
  total = sum(f for f, _ in rows.values())
  print(f"{args.size} {args.accum} x ({args.batch} x {args.seq}): matrix products outside "
        f"kernels {total / 1e12:.2f} TFLOP a step; useful (train_flops_per_token) "
        f"{useful / 1e12:.2f} TFLOP ({total / useful:.3f}x)")
  print("| TFLOP | share | runs | source |\n|---:|---:|---:|---|")
  for key, (f, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"| {f / 1e12:.3f} | {100 * f / total:.1f}% | {n:g} | {key} |")
  if kernels:
    print("kernels (runs a step):", ", ".join(f"{k} {v:g}" for k, v in kernels.most_common()))
  if unknown:
    print("while loops without a constant trip count (counted once):",
          ", ".join(f"{k} x{v:g}" for k, v in unknown.most_common()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
