"""Where a program's compile time goes on a GPU: per-kernel cost, XLA flag variants, and the train
step's pieces (model forward+backward, optimizer update, whole step), from abstract state (no
parameter memory is allocated, so any size compiles on one device).

  python benchmarks/gpu_compile.py chain --kernels 25 100            # cost per fusion
  python benchmarks/gpu_compile.py step --config configs/tiny.py --part fwd_bwd opt step
  python benchmarks/gpu_compile.py step --config configs/small.py:s1 --batch 2 --seq 1024

`chain` compiles a chain of K elementwise+reduction stages (one or two fusions each, all distinct,
so nothing is deduplicated) and prints seconds per fusion. `step` lowers and compiles each named
part and prints trace, lower and compile seconds, the compiled program's fusion and custom-call
(library GEMM) counts. Each run reads `XLA_FLAGS` as given (launch/xla_flags.py defaults applied
unless `DSV41_XLA_DEFAULTS=0`), so flag variants are compared by running the script once per
variant in the same device call (benchmarks/RESULTS.md, "Train step on one H200").
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import xla_flags  # noqa: E402

xla_flags.apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import header  # noqa: E402

_FUSION = re.compile(r"=\s*\S+\s+fusion\(")
_CUSTOM = re.compile(r"custom-call\(")


def kernel_counts(compiled) -> tuple[int, int]:
  """Fusion and custom-call instructions in the optimized program (every computation)."""
  text = compiled.as_text()
  return len(_FUSION.findall(text)), len(_CUSTOM.findall(text))


def chain(k: int):
  """K distinct stages: x ← normalize(sin(x)·c_i + i) along the last axis."""
  def f(x):
    for i in range(k):
      x = jnp.sin(x) * (1.0 + 0.01 * i) + i
      x = x / (jnp.sum(jnp.abs(x), axis=-1, keepdims=True) + 1.0)
    return x
  return f


def run_chain(ks):
  x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
  for k in ks:
    t0 = time.perf_counter()
    lowered = jax.jit(chain(k)).lower(x)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    fus, cc = kernel_counts(compiled)
    print(f"chain K={k}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, {fus} fusions, "
          f"{(t2 - t1) / max(fus, 1) * 1e3:.1f} ms per fusion", flush=True)


def run_step(config: str, parts, batch: int | None, seq: int | None):
  import optax
  from flax import nnx
  from configs.common import MeshConfig
  from dsv41_jax.loss import objective
  from launch import setup
  from launch.step import model_inputs
  from launch.ladder import load_config_file

  path, _, arg = config.partition(":")
  cfg = load_config_file(path, arg or None)
  if batch:
    cfg.data.batch_size = batch
  if seq:
    cfg.data.seq_len = seq
    cfg.model.seq_len = seq
  cfg.model.vision = None
  cfg.optim.frozen, cfg.optim.unfreeze_at = (), "never"
  run = setup.run_config(cfg, process_count=1)
  mesh = setup.build_mesh(MeshConfig(data=1), jax.devices()[:1])
  t0 = time.perf_counter()
  state = setup.abstract_state(run, mesh)
  batch_sds = setup.abstract_batch(run.model, run.data, run.data.batch_size)
  print(f"[{config}] abstract state {time.perf_counter() - t0:.1f} s; "
        f"batch {run.data.batch_size} × {run.data.seq_len}", flush=True)
  graphdef, tx, abstract = state.graphdef, state.tx, state.state

  def loss_fn(p, b, bias):
    logits, aux = nnx.merge(graphdef, p)(model_inputs(b), bias)
    return objective(run.model, logits, aux, b)[0]

  def update(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  programs = {
      "fwd": (jax.jit(loss_fn), (abstract.params, batch_sds, abstract.moe_bias)),
      "fwd_bwd": (jax.jit(jax.value_and_grad(loss_fn)),
                  (abstract.params, batch_sds, abstract.moe_bias)),
      "opt": (jax.jit(update), (abstract.params, abstract.opt_state, abstract.params)),
      "step": (setup.train_step_jit(run, state), (abstract, batch_sds, False)),
  }
  for part in parts:
    fn, args = programs[part]
    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      traced = fn.trace(*args)
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      hlo_mb = len(lowered.as_text()) / 1e6
      print(f"[{config}] {part}: trace {t1 - t0:.1f} s, lower {t2 - t1:.1f} s, "
            f"StableHLO {hlo_mb:.2f} MB; compiling…", flush=True)
      compiled = lowered.compile()
      t3 = time.perf_counter()
    fus, cc = kernel_counts(compiled)
    print(f"[{config}] {part}: compile {t3 - t2:.1f} s, {fus} fusions, {cc} custom calls",
          flush=True)


def main():
  ap = argparse.ArgumentParser()
  sub = ap.add_subparsers(dest="what", required=True)
  c = sub.add_parser("chain")
  c.add_argument("--kernels", type=int, nargs="+", default=[25, 100])
  s = sub.add_parser("step")
  s.add_argument("--config", default="configs/tiny.py")
  s.add_argument("--part", nargs="+", default=["fwd_bwd", "opt", "step"],
                 choices=["fwd", "fwd_bwd", "opt", "step"])
  s.add_argument("--batch", type=int, default=None)
  s.add_argument("--seq", type=int, default=None)
  args = ap.parse_args()
  print(header(), f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", sep="\n", flush=True)
  if args.what == "chain":
    run_chain(args.kernels)
  else:
    run_step(args.config, args.part, args.batch, args.seq)


if __name__ == "__main__":
  main()
