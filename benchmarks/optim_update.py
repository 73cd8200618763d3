"""The optimizer update of a small config from several source trees, side by side in one GPU call
(issue 25: before and after a change). Each tree runs in its own process, which imports that
tree's optim/, launch/, configs/ and dsv41_jax/ and times its programs on the same random inputs.

  # the base revision's packages into an ignored folder of this checkout (a device call carries it)
  mkdir -p build/optim_base && git archive BASE optim launch configs dsv41_jax pallas_kernels data \
      | tar -x -C build/optim_base
  python benchmarks/optim_update.py --roots build/optim_base .     # on the GPU, ~2 minutes

Programs, for `--size` (s3) at `--batch` × `--seq` (4 × 4096) as `benchmarks/gpu_step.py` builds
it (text rows, nothing frozen, Newton–Schulz policy "kernel": the bfloat16 iterate that "auto"
takes on a GPU):
  update         `tx.update` + `optax.apply_updates` on (gradients, optimizer state, parameters):
                 gpu_step's split "optimizer" program: its inputs are kept, so it also writes new
                 buffers for the parameters and the optimizer state
  update_donated the same update with the parameters and optimizer state donated and each call fed
                 the last one's outputs, as the jitted train step runs it (launch.setup donates the
                 state): the optimizer's own cost without the copies
  sinkhorn       the Sinkhorn direction of every Engram table with its sub-table layout
                 (gpu_step's `--sinkhorn`)
  newton_schulz  `optim.muon.orthogonalize_many` of every Muon-group parameter, as the update calls
                 it (`--programs` adds it; its compile takes about as long as the update's)
`--profile DIR` also profiles two calls of each program (command buffers off) and prints its kernel
time by component, file, function and line, as `benchmarks/gpu_profile.py` does for the step.
Inputs: normal × 0.02 for every float, zeros for integers, from one key, so trees whose programs
take the same leaves get the same values. Timing: this checkout's `benchmarks.common.time_calls`
(the first call, which compiles, timed apart; then the median of `--reps` calls).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

PROGRAMS = ("update", "update_donated", "sinkhorn", "newton_schulz")


def _args():
  ap = argparse.ArgumentParser()
  ap.add_argument("--roots", nargs="+", default=["."],
                  help="source trees to time, in order (the last is compared with the first)")
  ap.add_argument("--programs", nargs="+", default=["update", "update_donated", "sinkhorn"],
                  choices=PROGRAMS)
  ap.add_argument("--size", default="s3")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--json", default=None)
  ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                  help="config keys of every tree, e.g. optim.ns_schedule=polar_express "
                       "(benchmarks.common.set_overrides; a key a tree lacks stops its run)")
  ap.add_argument("--profile", default=None, metavar="DIR",
                  help="also profile each program (GPU; command buffers off) and print its kernel "
                       "time by source as benchmarks/gpu_profile.py does; traces and HLO in DIR")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)   # JSON path of one tree's run
  return ap.parse_args()


ARGS = _args()
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ARGS.child:
  sys.path.insert(0, os.path.abspath(ARGS.roots[0]))
  from launch import xla_flags  # noqa: E402
  xla_flags.apply_defaults()   # as launch.train does, before jax starts
  if ARGS.profile:             # each kernel names its XLA op (gpu_profile's module docstring)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()
else:
  sys.path.insert(0, _HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def _flat(fn, tree):
  """`fn` on the tree as a jitted function of its flat leaves, and the leaves' abstract values."""
  leaves, treedef = jax.tree.flatten(tree)
  return (jax.jit(lambda *xs: jax.tree.leaves(fn(jax.tree.unflatten(treedef, list(xs))))),
          [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])


def _flat_donated(fn, grads, state):
  """`fn(grads, state) -> state` jitted on flat leaves with the state's leaves donated: (function,
  abstract inputs, number of gradient leaves); the outputs are the new state's leaves, in order."""
  g_leaves, g_def = jax.tree.flatten(grads)
  s_leaves, s_def = jax.tree.flatten(state)
  n = len(g_leaves)

  def flat(*xs):
    new = fn(jax.tree.unflatten(g_def, list(xs[:n])), jax.tree.unflatten(s_def, list(xs[n:])))
    return jax.tree.leaves(new)

  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in g_leaves + s_leaves]
  return jax.jit(flat, donate_argnums=tuple(range(n, len(avals)))), avals, n


def _time_donated(fn, args, n_fixed: int, reps: int) -> tuple[float, float, list]:
  """`time_calls` for a program that donates its inputs past the first `n_fixed`: each call gets
  the fixed inputs and the last call's outputs (median seconds, first call's seconds, the inputs
  for a next call: the donated ones are gone)."""
  fixed, carry = list(args[:n_fixed]), list(args[n_fixed:])
  t0 = time.perf_counter()
  carry = jax.block_until_ready(fn(*fixed, *carry))
  first, times = time.perf_counter() - t0, []
  for _ in range(reps):
    t0 = time.perf_counter()
    carry = jax.block_until_ready(fn(*fixed, *carry))
    times.append(time.perf_counter() - t0)
  return float(sorted(times)[len(times) // 2]), first, fixed + list(carry)


def programs(names) -> dict:
  """name -> (jitted flat function, abstract inputs[, donated-from index]) of the tree on
  sys.path (module docstring)."""
  import optax
  from configs import small
  from configs.common import MeshConfig
  from dsv41_jax import model as model_lib
  from launch import setup
  from launch.step import engram_sub_tables
  from optim import muon, sinkhorn, table

  cfg = small.get_config(ARGS.size)
  _common().set_overrides(cfg, ARGS.set)
  cfg.data.seq_len, cfg.data.batch_size, cfg.model.seq_len = ARGS.seq, ARGS.batch, ARGS.seq
  if "grad_accum_steps" in cfg.train:
    cfg.train.grad_accum_steps = 1
  cfg.model.vision = None
  cfg.optim.frozen, cfg.optim.unfreeze_at = (), "never"
  cfg.optim.newton_schulz = "kernel"
  run = setup.run_config(cfg, process_count=1)
  ts = setup.abstract_state(run, setup.build_mesh(MeshConfig(data=1), jax.devices()[:1]))
  plain = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  params, opt_state = plain(ts.state.params), plain(ts.state.opt_state)
  tx, o = ts.tx, run.optim
  flat = dict(table.flatten_params(params))
  rows = table.label_params(params)

  def update(tree):
    g, s, p = tree
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def update_donated(g, state):
    s, p = state
    u, s = tx.update(g, s, p)
    return s, optax.apply_updates(p, u)

  def sinkhorn_program():
    layouts = engram_sub_tables(model_lib.abstract_model(run.model))
    stat = (o.sinkhorn_stat_dtype,) if hasattr(o, "sinkhorn_stat_dtype") else ()  # older trees
    return _flat(lambda gs: [sinkhorn.sinkhorn_direction(
        g, o.sinkhorn_iters, o.sinkhorn_tau, o.sinkhorn_eps, o.update_rms, layouts[p], *stat)
        for p, g in gs.items()], {p: flat[p] for p in sorted(layouts)})

  def newton_schulz_program():
    mats = sorted(p for p, r in rows.items() if r.group == "muon")
    schedule = {"ns_schedule": o.ns_schedule} if hasattr(o, "ns_schedule") else {}  # older trees
    return _flat(lambda gs: muon.orthogonalize_many(
        [gs[p] for p in mats], [rows[p].headwise for p in mats], "kernel", **schedule),
        {p: flat[p] for p in mats})

  build = {"update": lambda: _flat(update, (params, opt_state, params)),
           "update_donated": lambda: _flat_donated(update_donated, params, (opt_state, params)),
           "sinkhorn": sinkhorn_program, "newton_schulz": newton_schulz_program}
  return {n: build[n]() for n in names}


def _inputs(avals, seed: int = 0) -> list:
  """Normal × 0.02 for floats, zeros for the rest, made on the device by one program."""
  def make(key):
    keys = jax.random.split(key, len(avals))
    return [0.02 * jax.random.normal(k, a.shape, a.dtype)
            if jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros(a.shape, a.dtype)
            for k, a in zip(keys, avals)]
  return jax.block_until_ready(jax.jit(make)(jax.random.key(seed)))


def _load(name: str):
  """This checkout's `benchmarks/<name>.py` (a tree under test need not have it), loaded by path so
  that no other module of this checkout enters a child's imports (sys.path is restored)."""
  spec = importlib.util.spec_from_file_location(
      f"optim_update_{name}", os.path.join(_HERE, "benchmarks", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  saved = list(sys.path)
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module


def _common():
  return _load("common")


def _profile(name: str, fn, args, n_fixed: int | None, median_s: float) -> None:
  """Two calls of one program under the profiler, its kernel time by source (gpu_profile's
  grouping: the tree's own frames; a base tree's frames fall in "other")."""
  prof, summary = _load("gpu_profile"), _load("trace_summary")
  out = os.path.join(os.path.abspath(ARGS.profile), name)
  os.makedirs(out, exist_ok=True)
  compiled = fn.lower(*args).compile()
  with open(os.path.join(out, "program.hlo.txt"), "w") as f:
    f.write(compiled.as_text())
  hlo = prof.HloSources(compiled.as_text())
  with jax.profiler.trace(out, create_perfetto_trace=True):
    for _ in range(2):
      res = compiled(*args)
      if n_fixed is not None:       # the donated state comes back as the next call's
        args = list(args[:n_fixed]) + list(res)
      jax.block_until_ready(res)
  trace = sorted(glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True),
                 key=os.path.getmtime)[-1]
  spans, busy = prof.gpu_kernels(summary.load(trace))
  groups = prof.attribute(spans, hlo, steps=2)
  if not spans:
    print(f"[{ARGS.roots[0]}] {name}: no GPU kernels in the trace ({jax.default_backend()})")
    return
  print(f"[{ARGS.roots[0]}] {name}, profiled (\"step\" = the program's median call):")
  print(prof.report(groups, median_s * 1e3, busy / 1e3 / 2, 15), flush=True)


def child(path: str) -> None:
  """Time the programs of the tree `ARGS.roots[0]`; write their figures to `path`."""
  out = []
  for name, (fn, avals, *donated) in programs(ARGS.programs).items():
    args = _inputs(avals)
    if donated:
      median, first, args = _time_donated(fn, args, donated[0], ARGS.reps)
    else:
      median, first = _common().time_calls(fn, *args, reps=ARGS.reps)
    if ARGS.profile:
      _profile(name, fn, args, donated[0] if donated else None, median)
    del args
    out.append(dict(program=name, root=ARGS.roots[0], median_s=median, first_s=first))
    print(f"[{ARGS.roots[0]}] {name}: {median * 1e3:.1f} ms (first call {first:.1f} s)",
          flush=True)
  with open(path, "w") as f:
    json.dump(out, f)


def main() -> None:
  header, md_header = _common().header, _common().md_header
  rows = []
  for root in ARGS.roots:
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
      cmd = [sys.executable, os.path.abspath(__file__), "--child", tmp.name, "--roots",
             os.path.abspath(root),   # the child runs in the tree: a relative root would not resolve
             "--programs", *ARGS.programs, "--size", ARGS.size, "--batch", str(ARGS.batch),
             "--seq", str(ARGS.seq), "--reps", str(ARGS.reps),
             *(["--profile", os.path.abspath(ARGS.profile)] if ARGS.profile else []),
             *(["--set", *ARGS.set] if ARGS.set else [])]
      subprocess.run(cmd, check=True, cwd=os.path.abspath(root))
      with open(tmp.name) as f:
        rows += json.load(f)
  print("\n" + header())
  print(f"{ARGS.size}, optimizer of a {ARGS.batch} × {ARGS.seq} step; median of {ARGS.reps} calls "
        "(first call, with the compile, in parentheses)")
  cols = [f"`{r}`" for r in ARGS.roots]
  print(md_header("program", *cols, *(["last / first"] if len(ARGS.roots) > 1 else [])))
  for name in ARGS.programs:
    got = [r for r in rows if r["program"] == name]
    cells = [f"{r['median_s'] * 1e3:,.1f} ms ({r['first_s']:.0f} s)" for r in got]
    ratio = [f"{got[-1]['median_s'] / got[0]['median_s']:.2f}"] if len(got) > 1 else []
    print(f"| {name} | " + " | ".join(cells + ratio) + " |")
  if ARGS.json:
    with open(ARGS.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  if ARGS.child:
    child(ARGS.child)
  else:
    main()
