"""The cold start's initialisation program: compile time with and without XLA's backend
optimisation, side by side in one process (issue 33 item 8).

  python benchmarks/init_compile.py [--config configs/tiny.py] [--reps 1]

`dsv41_jax.model.init_model` compiles the whole model's initialisation (every parameter drawn
with its sharding) as one program. It runs once per run, so on the CPU its program is built
with `xla_backend_optimization_level=0` (`model._CPU_INIT_OPTIONS`); this script compiles the
same lowered program both ways (the persistent compilation cache off) and prints the two compile
times, their ratio and the run time of each compiled program.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import header, log, median_seconds  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/tiny.py")
  ap.add_argument("--reps", type=int, default=1, help="compiles of each kind (median reported)")
  args = ap.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  from dsv41_jax import model as model_lib, sharding
  from launch import setup
  spec = importlib.util.spec_from_file_location("cfg", args.config)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  run = setup.run_config(mod.get_config())
  mesh = setup.build_mesh(run.mesh)
  cfg = run.model
  print(header())
  with jax.set_mesh(mesh):
    _, abs_state = nnx.split(model_lib.abstract_model(cfg))
    shardings = sharding.state_shardings(abs_state, mesh)
    init = jax.jit(lambda: nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))[1],
                   out_shardings=shardings)
    t0 = time.perf_counter()
    lowered = init.trace().lower()
    lower_s = time.perf_counter() - t0
    rows = []
    for name, options in [("optimised (XLA default)", {}),
                          ("backend optimisation off", model_lib._CPU_INIT_OPTIONS)]:
      times, compiled = [], None
      for _ in range(args.reps):
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=options)
        times.append(time.perf_counter() - t0)
      compile_s = sorted(times)[len(times) // 2]
      run_s = median_seconds(compiled, reps=3)
      log(f"{name}: compile {compile_s:.1f} s, run {run_s * 1e3:.1f} ms")
      rows.append((name, compile_s, run_s))
  print(f"\ntrace + lower {lower_s:.1f} s, {model_lib.param_count(abs_state):,} parameters\n")
  print("| init program | compile (s) | run (ms) |\n|---|---|---|")
  for name, c, r in rows:
    print(f"| {name} | {c:.1f} | {r * 1e3:.1f} |")
  print(f"\ncompile ratio (optimised / off): {rows[0][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
  main()
