"""The compile command: the train step for a mesh compiled ahead of time, its memory read back
(docs/design.md §T1).

  python -m launch.aot --config=configs/tiny.py --mesh=data:8,expert:4 --batch=32
  python -m launch.aot --config=configs/flash.py --mesh=fsdp:8,expert:8,engram:8 --analytic
  python -m launch.aot --config=configs/flash.py --mesh=fsdp:8,expert:8,engram:8 \
      --rules=engram_rows=engram+fsdp+expert          # what-if: another mapping of one logical axis
  python -m launch.aot --config=configs/small.py:s3 --mesh=data:1 --batch=32 --analytic \
      --backend=gpu                                   # the estimate for a GPU, made on the CPU

Compiled plan: the train step of `launch.step` is lowered with abstract arguments that carry their
shardings (parameters per `sharding.RULES`, optimizer buffers like their parameters, the batch over
the batch axes) and compiled for fake CPU devices, one per mesh position, without running. It
prints XLA's per-device `memory_analysis()` (arguments, outputs, aliased donations, temporaries)
beside the analytic plan of `launch.memory_plan`, so the estimate can be checked on every config
that compiles. With `--analytic`, and automatically above `--max_compile_params`, only the
analytic plan is printed. The analytic activations are for `--backend` (default: the machine it
runs on, the CPU): the op policies take kernels on a GPU that keep no score-sized buffers
(`launch.memory_plan.kernels_taken`).

`--rules` overrides entries of `sharding.RULES` and the plan runs under the whole resulting table
(`sharding.use_rules`): parameter, optimizer-state and batch shardings, and in the compiled plan
the model's activation constraints and its MoE and Engram exchanges too. The report prints the
rules that split something on this mesh.
"""

from __future__ import annotations

import os
import sys


def _flag(argv: list[str], name: str) -> str | None:
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      return a.split("=", 1)[1]
    if a == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _preset_host_devices(argv: list[str]) -> None:
  """Give the CPU backend one fake device per mesh position; must run before jax is imported."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  n = _flag(argv, "devices")
  if n is None:
    text = _flag(argv, "mesh")
    try:
      sizes = [int(p.split(":", 1)[1]) for p in (text or "").split(",") if p.strip()]
    except (IndexError, ValueError):
      return  # parse_mesh reports the error once flags are parsed
    if not sizes or any(s < 1 for s in sizes):
      return
    n = 1
    for s in sizes:
      n *= s
  flags_ = os.environ.get("XLA_FLAGS", "")
  flags_ = " ".join(f for f in flags_.split() if "xla_force_host_platform_device_count" not in f)
  os.environ["XLA_FLAGS"] = f"{flags_} --xla_force_host_platform_device_count={n}".strip()


if __name__ == "__main__":
  _preset_host_devices(sys.argv)

import dataclasses  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any, Mapping  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from configs.common import model_config  # noqa: E402
from data.config import data_config  # noqa: E402
from dsv41_jax import flops, sharding  # noqa: E402
from dsv41_jax.config import ModelConfig  # noqa: E402
from dsv41_jax.errors import ConfigError  # noqa: E402
from dsv41_jax.loss import objective  # noqa: E402
from launch import setup  # noqa: E402
from launch.memory_plan import (  # noqa: E402
    PlanError, analytic_plan, batch_ways, global_batch_for, mesh_str, parse_mesh, parse_rules,
    resolve_mesh)
from launch.step import make_train_step, model_inputs  # noqa: E402

GiB = 1024 ** 3
# Above this many parameters the tool does not try to compile on this host (auto analytic plan).
DEFAULT_MAX_COMPILE_PARAMS = 2e9


# --- compiled plan ------------------------------------------------------------------------------

def abstract_batch(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, global_batch: int,
                   sharding_: NamedSharding | None = None) -> dict[str, Any]:
  """ShapeDtypeStructs of one global batch as `launch.train` feeds it (`launch.setup`'s batch
  adapter: data/packing.py rows plus Engram rows per Engram layer), each split over the batch
  axes like `sharding_`."""
  return setup.abstract_batch(mcfg, data_config(cfg.data), global_batch, sharding_)


@dataclasses.dataclass
class Lowered:
  step: Any                 # the train step function (launch.step.make_train_step)
  args: tuple               # abstract (state: launch.step.TrainState, batch)
  out_shardings: tuple
  mesh: jax.sharding.Mesh
  rules: Mapping[str, Any] = dataclasses.field(default_factory=lambda: dict(sharding.RULES))
  graphdef: Any = None      # the model's nnx.GraphDef
  model_cfg: Any = None     # its ModelConfig


def lower_args(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, global_batch: int,
               rules=None) -> Lowered:
  """The train step and its abstract, sharded arguments, built as `launch.train.run` builds them,
  under `rules` (default: the active table)."""
  rules = dict(sharding.active_rules() if rules is None else rules)
  with sharding.use_rules(rules):
    run = setup.run_config(cfg, process_count=1)
    run = dataclasses.replace(run, optim=dataclasses.replace(
        run.optim, tokens_per_step=global_batch * run.data.seq_len))
    ts = setup.abstract_state(run, mesh, rules)
    batch = abstract_batch(cfg, run.model, global_batch, sharding.batch_sharding(mesh, 1, rules))
    step = make_train_step(run.model, ts.graphdef, ts.tx, run.optim.moe_bias_gamma,
                           run.train.grad_accum_steps)
  return Lowered(step, (ts.state, batch), (ts.shardings, ts.replicated), mesh, rules,
                 ts.graphdef, run.model)


def compile_train_step(low: Lowered):
  """Lower and compile (never run) the donated, sharded train step; (compiled, seconds)."""
  t0 = time.perf_counter()
  with jax.set_mesh(low.mesh), sharding.use_rules(low.rules):
    compiled = jax.jit(low.step, donate_argnums=(0,),
                       out_shardings=low.out_shardings).lower(*low.args).compile()
  return compiled, time.perf_counter() - t0


def compile_grad_step(low: Lowered):
  """Lower and compile (never run) the gradient of the training objective alone, parameters and
  batch sharded as in `low`: XLA's memory analysis of it is parameters + gradients + activations,
  the part of the plan that `activation_bytes` estimates (the optimizer state is exact by
  construction). (compiled, seconds)."""
  state, batch = low.args
  gdef, mcfg = low.graphdef, low.model_cfg

  def loss(params, bias, batch):
    logits, aux = nnx.merge(gdef, params)(model_inputs(batch), bias)
    return objective(mcfg, logits, aux, batch)[0]

  t0 = time.perf_counter()
  with jax.set_mesh(low.mesh), sharding.use_rules(low.rules):
    compiled = jax.jit(jax.grad(loss), out_shardings=low.out_shardings[0].params).lower(
        state.params, state.moe_bias, batch).compile()
  return compiled, time.perf_counter() - t0


def xla_flops(compiled) -> float:
  """`cost_analysis()['flops']`: a dict on some jax versions, a list of one dict on others."""
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return float(ca.get("flops", float("nan")))


def memory_stats(compiled) -> dict[str, float]:
  """XLA's per-device memory analysis; peak ≈ arguments + outputs − aliased + temporaries."""
  m = compiled.memory_analysis()  # None where a backend does not report it
  out = {k: float(getattr(m, f"{k}_size_in_bytes", 0) or 0) if m is not None else float("nan")
         for k in ("argument", "output", "alias", "temp", "generated_code")}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def compiled_plan(cfg: ml_collections.ConfigDict, sizes: Mapping[str, int], global_batch: int,
                  rules=None, devices=None, hlo_out: str | None = None) -> dict[str, Any]:
  """XLA's figures of the compiled train step; with `hlo_out`, its compiled HLO text written
  there (for `benchmarks/hlo_traffic.py`)."""
  devices = list(jax.devices() if devices is None else devices)
  n = math.prod(sizes.values())
  if n > len(devices):
    raise PlanError(f"mesh {mesh_str(sizes)} needs {n} devices but jax sees {len(devices)}")
  mesh = sharding.make_mesh(sizes, devices[:n])
  low = lower_args(cfg, mesh, global_batch, rules)
  compiled, seconds = compile_train_step(low)
  if hlo_out:
    with open(hlo_out, "w") as f:
      f.write(compiled.as_text())
  mcfg = model_config(cfg)
  return {"memory": memory_stats(compiled), "compile_seconds": seconds,
          "xla_flops_per_device": xla_flops(compiled),
          "formula_flops": flops.train_flops_per_token(mcfg.replace(seq_len=cfg.data.seq_len))
          * global_batch * cfg.data.seq_len}


# --- report -------------------------------------------------------------------------------------

def _gib(x: float) -> str:
  return f"{x / GiB:10.3f} GiB" if x >= GiB else f"{x / 2**20:10.3f} MiB"


def format_plan(name: str, plan: dict[str, Any], compiled: dict[str, Any] | None) -> str:
  lines = []
  kind = "compiled + analytic" if compiled else "ANALYTIC (not compiled: estimate from shapes)"
  lines.append(f"memory plan for {name}: {kind}")
  lines.append(f"  mesh {mesh_str(plan['mesh'])} ({math.prod(plan['mesh'].values())} devices); "
               f"global batch {plan['global_batch']} × seq {plan['seq_len']}, "
               f"{plan['rows_per_device']} row(s) per device (batch over {plan['batch_axes']})"
               f"{plan.get('batch_note', '')}")
  lines.append(f"  parameters {plan['total_params']:,} in total")
  lines.append("  mesh axes:")
  for a, fam in plan["axes_use"].items():
    batch = " + the batch" if a in plan["batch_axes"] else ""
    lines.append(f"    {a:7s} ({plan['mesh'][a]}): {fam}{batch}")
  lines.append("  rules (logical axis -> mesh axes, those that split something on this mesh):")
  rules = plan.get("rules", {})
  for k in range(0, len(rules), 4):
    lines.append("    " + "; ".join(f"{n} -> {'+'.join(a)}" for n, a in list(rules.items())[k:k + 4]))
  lines.append("  per device (analytic):")
  lines.append(f"    parameters     {_gib(plan['param_bytes'])}   by group: " + ", ".join(
      f"{g} {_gib(v).strip()}" for g, v in sorted(plan["param_bytes_by_group"].items())))
  k = plan.get("grad_accum_steps", 1)
  lines.append(f"    gradients      {_gib(plan['grad_bytes'])}" + (
      f"   (accumulator + one micro-batch's; {k} micro-batches of "
      f"{plan['rows_per_device'] // k} row(s) per device)" if k > 1 else ""))
  lines.append(f"    optimizer      {_gib(plan['opt_bytes'])}   (1 buffer muon/sinkhorn, 2 adamw)")
  act = plan["activation_bytes"]
  lines.append(f"    activations    {_gib(act['total'])}   estimate for {plan['backend']}: carries "
               f"{_gib(act['carries']).strip()} + largest layer {_gib(act['layer_work']).strip()} + "
               f"logits {_gib(act['logits']).strip()}")
  lines.append(f"    total          {_gib(plan['total_bytes'])}")
  if compiled:
    m = compiled["memory"]
    lines.append(f"  per device (XLA memory_analysis, compiled in {compiled['compile_seconds']:.1f} s):")
    lines.append(f"    arguments      {_gib(m['argument'])}   (params + optimizer state + batch)")
    lines.append(f"    outputs        {_gib(m['output'])}   aliased with donated inputs "
                 f"{_gib(m['alias']).strip()}")
    lines.append(f"    temporaries    {_gib(m['temp'])}   (gradients, activations, workspace)")
    lines.append(f"    peak           {_gib(m['peak'])}")
    lines.append(f"  XLA cost_analysis flops per device {compiled['xla_flops_per_device']:.4g}; model "
                 f"FLOPs of the step (formula, all devices) {compiled['formula_flops']:.4g} "
                 f"(not comparable with scan/remat/optimizer: see dsv41_jax/flops.py)")
  return "\n".join(lines)


def plan(cfg: ml_collections.ConfigDict, mesh_text: str, *, batch: int | None = None,
         seq_len: int | None = None, devices: int | None = None, analytic: bool = False, rules_text: str | None = None,
         max_compile_params: float = DEFAULT_MAX_COMPILE_PARAMS, name: str = "config",
         hlo_out: str | None = None, backend: str | None = None
         ) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
  """The whole tool as a function: (analytic plan, compiled figures or None, printed report).
  `backend`: the machine the analytic activations are estimated for (None: this process's)."""
  rules = parse_rules(rules_text)
  shape = parse_mesh(mesh_text)
  if seq_len is not None:
    if seq_len < 1:
      raise PlanError(f"--seq={seq_len} must be positive")
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    cfg.data.seq_len = seq_len
  if devices is None and -1 not in shape.values():
    devices = math.prod(shape.values())
  sizes = resolve_mesh(shape, devices)
  mcfg = model_config(cfg)
  axes, ways = batch_ways(sizes, rules)
  gb, note = global_batch_for(batch, cfg.data.batch_size, ways)
  a_plan = analytic_plan(mcfg, sizes, gb, cfg.data.seq_len, rules,
                         cfg.optim.get("chain", "muon"), cfg.train.get("grad_accum_steps", 1),
                         backend=backend)
  a_plan["batch_note"] = note
  compiled = None
  reason = ""
  if not analytic and a_plan["total_params"] > max_compile_params:
    reason = (f"  ({a_plan['total_params']:,} parameters > --max_compile_params="
              f"{max_compile_params:.3g}: analytic plan only)")
    analytic = True
  if hlo_out and analytic:
    raise PlanError("--hlo_out needs the compiled plan (no --analytic; raise "
                    "--max_compile_params above the config's parameters)")
  if not analytic:
    c_cfg = ml_collections.ConfigDict(cfg.to_dict())
    c_cfg.data.batch_size = gb
    compiled = compiled_plan(c_cfg, sizes, gb, rules, hlo_out=hlo_out)
  text = format_plan(name, a_plan, compiled)
  if reason:
    head, rest = text.split("\n", 1)
    text = f"{head}\n{reason}\n{rest}"
  return a_plan, compiled, text


def main(argv):
  from absl import app, flags  # noqa: F401
  del argv
  F = flags.FLAGS
  try:
    _, _, text = plan(_CONFIG.value, F.mesh, batch=F.batch, seq_len=F.seq, devices=F.devices,
                      analytic=F.analytic, rules_text=F.rules,
                      max_compile_params=F.max_compile_params,
                      name=_flag(sys.argv, "config") or "config", hlo_out=F.hlo_out,
                      backend=F.backend)
  except (PlanError, ConfigError, sharding.ShardingError, setup.SetupError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(text)


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  from launch import cli
  _CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
  flags.DEFINE_string("mesh", None, "Mesh, e.g. data:8,expert:4 (axes: "
                      + ", ".join(sharding.MESH_AXES) + "; one may be -1 with --devices).")
  flags.DEFINE_integer("batch", None, "Global batch (default: data.batch_size, rounded up to the "
                       "batch shards).")
  flags.DEFINE_integer("seq", None, "Sequence length (default: data.seq_len).")
  flags.DEFINE_integer("devices", None, "Device count (default: the mesh's product).")
  flags.DEFINE_bool("analytic", False, "Analytic plan only (no compile).")
  flags.DEFINE_string("rules", None, "Override sharding rules: 'logical=axis+axis;logical=none'.")
  flags.DEFINE_float("max_compile_params", DEFAULT_MAX_COMPILE_PARAMS,
                     "Above this many parameters, plan analytically.")
  flags.DEFINE_enum("backend", None, ["gpu", "cpu", "tpu"], "The machine the analytic "
                    "activation estimate is for: which kernels the op policies take there "
                    "(default: this process's jax backend).")
  flags.DEFINE_string("hlo_out", None, "Write the compiled train step's HLO text here "
                      "(benchmarks/hlo_traffic.py reads it).")
  flags.mark_flags_as_required(["config", "mesh"])
  app.run(main, flags_parser=cli.parse_flags)
