"""Per-device memory plan of the train step for a mesh, compiled ahead of time or analytic (docs/design.md §T1).

  python -m launch.aot --config=configs/tiny.py --mesh=data:8,expert:4 --batch=32
  python -m launch.aot --config=configs/flash.py --mesh=fsdp:8,expert:8,engram:8 --analytic
  python -m launch.aot --config=configs/flash.py --mesh=fsdp:8,expert:8,engram:8 \
      --rules=engram_rows=engram+fsdp+expert          # what-if: another mapping of one logical axis

Compiled plan: the train step of `launch.step` is lowered with abstract arguments that carry their
shardings (parameters per `sharding.RULES`, optimizer buffers like their parameters, the batch over
the batch axes) and compiled for fake CPU devices, one per mesh position, without running. It
prints XLA's per-device `memory_analysis()` (arguments, outputs, aliased donations, temporaries)
beside the analytic figures below, so the estimate can be checked on every config that compiles.

Analytic plan (`--analytic`, and automatically above `--max_compile_params`): from shapes and
shardings alone, per device,
  parameters   Σ_leaves Π_d ⌈n_d / ways_d⌉ · itemsize(param_dtype), ways_d = product of the mesh
               axes that dimension d is split over,
  gradients    the same (gradients take their parameters' dtype and sharding),
  optimizer    Σ_leaves buffers(group) · the same, buffers = 1 for muon / sinkhorn, 2 for adamw
               (`optim.table.STATE_BUFFERS`; groups from `optim.table.label_params`),
  activations  an estimate (`activation_bytes`), whose formula is in that function's docstring.
The batch is split over the mesh axes of the logical axis "batch"; b = global batch / those ways.

`--rules` overrides entries of `sharding.RULES` and the plan runs under the whole resulting table
(`sharding.use_rules`): parameter, optimizer-state and batch shardings, and in the compiled plan
the model's activation constraints and its MoE and Engram exchanges too. The report prints the
rules that split something on this mesh. A table that leaves a parameter's logical axis unmapped,
maps a mesh axis twice within a parameter, or splits a dimension the mesh cannot divide is an
error naming the parameter (and the dimension and axis).
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
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from configs.common import model_config  # noqa: E402
from data.config import data_config  # noqa: E402
from dsv41_jax import flops, model as model_lib, sharding  # noqa: E402
from dsv41_jax.config import ConfigError, ModelConfig  # noqa: E402
from dsv41_jax.layer_plan import build_layer_plan  # noqa: E402
from launch import setup  # noqa: E402
from optim import table as table_lib  # noqa: E402

GiB = 1024 ** 3
# Above this many parameters the tool does not try to compile on this host (auto analytic plan).
DEFAULT_MAX_COMPILE_PARAMS = 2e9


class PlanError(ValueError):
  """Bad mesh, rules or batch for a plan; the message says what to change."""


# --- inputs: mesh, rules, batch -----------------------------------------------------------------

def parse_mesh(text: str) -> dict[str, int]:
  """'data:8,expert:4' → {'data': 8, 'expert': 4}; axes from `sharding.MESH_AXES`, one may be -1."""
  out: dict[str, int] = {}
  for part in (p.strip() for p in text.split(",")):
    if not part:
      continue
    name, sep, size = part.partition(":")
    name = name.strip()
    if not sep:
      raise PlanError(f"mesh entry {part!r} is not AXIS:SIZE (e.g. --mesh=data:8,expert:4)")
    if name not in sharding.MESH_AXES:
      raise PlanError(f"unknown mesh axis {name!r} in {text!r}; the mesh axes are "
                      f"{', '.join(sharding.MESH_AXES)}")
    if name in out:
      raise PlanError(f"mesh axis {name!r} given twice in {text!r}")
    try:
      n = int(size)
    except ValueError:
      raise PlanError(f"mesh axis {name!r} has size {size!r}, not an integer") from None
    if n < 1 and n != -1:
      raise PlanError(f"mesh axis {name!r} has size {n}; sizes are positive (or one -1)")
    out[name] = n
  if not out:
    raise PlanError("empty mesh; give e.g. --mesh=data:8,expert:4")
  if list(out.values()).count(-1) > 1:
    raise PlanError(f"at most one mesh axis may be -1 in {text!r}")
  return out


def resolve_mesh(shape: Mapping[str, int], n_devices: int | None) -> dict[str, int]:
  """Every MESH_AXES size (missing = 1, a -1 takes the rest); checks the product == n_devices."""
  sizes = {a: int(shape.get(a, 1)) for a in sharding.MESH_AXES}
  fixed = math.prod(s for s in sizes.values() if s != -1)
  free = [a for a, s in sizes.items() if s == -1]
  if free:
    if n_devices is None:
      raise PlanError(f"mesh axis {free[0]!r} is -1: give --devices so its size is known")
    if n_devices % fixed:
      raise PlanError(f"the fixed mesh axes multiply to {fixed}, which does not divide the "
                      f"{n_devices} devices")
    sizes[free[0]] = n_devices // fixed
  total = math.prod(sizes.values())
  if n_devices is not None and total != n_devices:
    raise PlanError(f"mesh {_mesh_str(sizes)} has {total} positions but there are {n_devices} "
                    f"devices; change the axis sizes so their product is {n_devices}")
  return sizes


def _mesh_str(sizes: Mapping[str, int]) -> str:
  return ",".join(f"{a}:{s}" for a, s in sizes.items() if s != 1) or "(1 device)"


def parse_rules(text: str | None, base=None) -> dict[str, Any]:
  """`base` (default `sharding.RULES`) with overrides 'logical=axis+axis;logical2=none' (none =
  replicated)."""
  rules = dict(sharding.RULES if base is None else base)
  if not text:
    return rules
  for part in (p.strip() for p in text.split(";")):
    if not part:
      continue
    name, sep, target = part.partition("=")
    name = name.strip()
    if not sep or name not in rules:
      raise PlanError(f"rule {part!r}: expected LOGICAL=AXIS[+AXIS...] with LOGICAL one of the "
                      f"logical axes in dsv41_jax.sharding.RULES")
    axes = tuple(t.strip() for t in target.split("+") if t.strip())
    if axes in ((), ("none",)):
      rules[name] = None
      continue
    bad = [a for a in axes if a not in sharding.MESH_AXES]
    if bad:
      raise PlanError(f"rule {part!r}: unknown mesh axes {bad}; the mesh axes are "
                      f"{', '.join(sharding.MESH_AXES)}")
    rules[name] = axes[0] if len(axes) == 1 else axes
  try:
    return sharding.check_table(rules)
  except sharding.ShardingError as e:
    raise PlanError(str(e)) from None


def batch_ways(sizes: Mapping[str, int], rules: Mapping[str, Any]) -> tuple[tuple[str, ...], int]:
  """The mesh axes the batch is split over and their product (`sharding.batch_axes`)."""
  return sharding.batch_axes(sizes, rules), sharding.batch_ways(sizes, rules)


def global_batch_for(requested: int | None, per_config: int, ways: int) -> tuple[int, str]:
  """The global batch: `requested` (which must split over `ways`), else the config's batch
  rounded up to a multiple of `ways` (with a note saying so)."""
  if requested is not None:
    if requested < 1 or requested % ways:
      raise PlanError(f"--batch={requested} does not split over the mesh's {ways} batch shards; "
                      f"use a positive multiple of {ways}")
    return requested, ""
  b = -(-per_config // ways) * ways
  note = "" if b == per_config else (f" (config batch {per_config} rounded up to a multiple of the "
                                     f"{ways} batch shards)")
  return b, note


# --- analytic plan ------------------------------------------------------------------------------

def _spec_ways(spec: P, sizes: Mapping[str, int]) -> list[int]:
  return [sharding.axes_size(sizes, () if e is None else ((e,) if isinstance(e, str) else e))
          for e in spec]


def param_shards(cfg: ModelConfig, sizes: Mapping[str, int], rules=None):
  """(path, shape, PartitionSpec, per-device elements, optimizer group) for every parameter.

  Raises `PlanError` naming the parameter (and dimension and axis) that the rules or the mesh
  cannot partition.
  """
  state = model_lib.abstract_params(cfg)
  try:
    specs = sharding.state_partition_specs(state, rules)
  except sharding.ShardingError as e:
    raise PlanError(str(e)) from None
  mesh_axes = {a for a, s in sizes.items() if s > 1}
  groups = {p: r.group for p, r in table_lib.label_params(state).items()}
  spec_by_path = dict(table_lib.flatten_params(specs))
  out = []
  for path, leaf in table_lib.flatten_params(state):
    spec = spec_by_path[path]
    spec = P(*(_keep_axes(e, mesh_axes) for e in spec))
    try:
      sharding.check_divisible(tuple(leaf.shape), spec, sizes, path)
    except sharding.ShardingError as e:
      raise PlanError(str(e)) from None
    ways = _spec_ways(spec, sizes)
    local = math.prod(n // w for n, w in zip(leaf.shape, ways))
    out.append((path, tuple(leaf.shape), spec, local, groups[path]))
  return out


def _keep_axes(entry, names):
  if entry is None:
    return None
  kept = tuple(e for e in ((entry,) if isinstance(entry, str) else entry) if e in names)
  return kept if len(kept) > 1 else (kept[0] if kept else None)


# Live float32 buffers of a layer's score size ([b, H, T, N] global scores, [b, 512, H_I, N]
# indexer logits) while the recomputed layer runs its backward: scores, mask, probabilities and
# their cotangents. Measured, not derived: XLA's memory analysis of the micro model's gradient
# step (tests/launch/micro_config.py, data 2 × fsdp 2, batch 8, remat) at T = 128, 256, 512 fits
# peak ≈ 0.028·T + 5.3·(score bytes of the largest layer) + 0.4 MiB; checked at other shapes by
# tests/launch/test_memory_plan.py.
SCORE_COPIES = 5


def activation_bytes(cfg: ModelConfig, b: int, T: int, sizes: Mapping[str, int]) -> dict[str, float]:
  """Estimated activation bytes per device for b rows of T tokens (an estimate, not a measurement).

  With layer remat (cfg.remat) every layer keeps only its input carry for the backward pass; the
  largest layer is then recomputed with all its intermediates live, values and their cotangents
  both. Terms (a = itemsize of cfg.dtype, tp = the tensor axis size, N = hc_mult):
    carries      (L + 1) · b·T·N·D·4                      f32 residual streams saved per layer
                 (without remat: every layer's working set below is kept instead)
    layer work   max over layers of 2·(attention + moe + mhc) + SCORE_COPIES·scores, per layer
      attention  b·T·(H/tp)·Dh·a  (q)  +  b·(H/tp)·T·(P+1)·S·4  (window scores, S = min(W, T),
                 P = ⌈(W−1)/S⌉ previous blocks)  +  "gather" global branch b·T·K·Dh·a + b·(H/tp)·T·K·4
      scores     "masked" global scores b·(H/tp)·T·⌈T/m⌉·4  +  indexer b·min(512, T)·H_I·⌈T/m⌉·4
                 (SCORE_COPIES live copies: measured, see the constant)
      moe        b·T·k·(D + 3·I/tp)·a + b·T·k·D·4     (sorted pairs, gate/up/act, f32 outputs)
      mhc        4 · b·T·N·D·4                         (pre/post mixes of the streams, f32)
    logits       3 · b·T·(V/tp)·4                      (f32 logits, softmax, their gradient)
  """
  a = jnp.dtype(cfg.dtype).itemsize
  tp = sizes.get("tensor", 1)
  D, N, H, Dh = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
  Ht = -(-H // tp)
  plan = build_layer_plan(cfg)
  stream = b * T * N * D * 4
  S = min(cfg.sliding_window, T)
  prev = -(-(cfg.sliding_window - 1) // S)

  def layer(spec) -> tuple[float, float]:
    att = b * T * Ht * Dh * a + b * Ht * T * (prev + 1) * S * 4
    scores = 0.0
    if spec.compress_ratio:
      n_ent = -(-T // spec.compress_ratio)
      K = min(cfg.index_topk, n_ent)
      if cfg.global_attn_impl == "masked":
        scores += b * Ht * T * n_ent * 4
      else:
        att += b * T * K * Dh * a + b * Ht * T * K * 4
      if spec.owns_indexer:
        scores += b * min(512, T) * cfg.index_n_heads * n_ent * 4
    k, I = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    moe = b * T * k * (D + 3 * -(-I // tp)) * a + b * T * k * D * 4
    return att + moe + 4 * stream, scores

  per_layer = [2 * lin + SCORE_COPIES * sc for lin, sc in map(layer, plan.layers)]
  if cfg.remat:
    carries = (len(per_layer) + 1) * stream
    work = max(per_layer)
  else:
    carries = 0.0
    work = sum(per_layer)
  logits = 3 * b * T * -(-cfg.vocab_size // tp) * 4
  return {"carries": float(carries), "layer_work": float(work), "logits": float(logits),
          "total": float(carries + work + logits)}


def analytic_plan(cfg: ModelConfig, sizes: Mapping[str, int], global_batch: int, seq_len: int,
                  rules=None) -> dict[str, Any]:
  """Per-device bytes of parameters, gradients, optimizer state and activations (see module doc)."""
  rules = dict(sharding.active_rules() if rules is None else rules)
  rows = param_shards(cfg, sizes, rules)
  item = jnp.dtype(cfg.param_dtype).itemsize
  params = sum(r[3] for r in rows) * item
  opt = sum(table_lib.STATE_BUFFERS[r[4]] * r[3] for r in rows) * item
  axes, ways = batch_ways(sizes, rules)
  if global_batch % ways:
    raise PlanError(f"global batch {global_batch} does not split over the {ways} batch shards "
                    f"{axes}")
  b = global_batch // ways
  act = activation_bytes(cfg, b, seq_len, sizes)
  by_group: dict[str, float] = {}
  for r in rows:
    by_group[r[4]] = by_group.get(r[4], 0.0) + r[3] * item
  return {
      "mesh": dict(sizes), "global_batch": global_batch, "rows_per_device": b,
      "seq_len": seq_len, "batch_axes": axes,
      "total_params": sum(math.prod(r[1]) for r in rows),
      "param_bytes": float(params), "grad_bytes": float(params), "opt_bytes": float(opt),
      "param_bytes_by_group": by_group,
      "activation_bytes": act,
      "total_bytes": float(2 * params + opt + act["total"]),
      "axes_use": axis_use(rows, sizes),
      "rules": rules_used(rules, sizes),
  }


def rules_used(rules: Mapping[str, Any], sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
  """The rules that split something on this mesh: logical axis -> its mesh axes of size > 1."""
  out = {}
  for name in rules:
    axes = sharding.mesh_axes(sizes, name, rules)
    if axes:
      out[name] = axes
  return out


def axis_use(rows, sizes: Mapping[str, int]) -> dict[str, str]:
  """For each mesh axis of size > 1: the parameter families it splits (and whether the batch)."""
  fam: dict[str, set[str]] = {a: set() for a, s in sizes.items() if s > 1}
  for path, _, spec, _, _ in rows:
    for entry in spec:
      for n in () if entry is None else ((entry,) if isinstance(entry, str) else entry):
        if n in fam:
          fam[n].add(_family(path))
  return {a: ", ".join(sorted(f)) or "(no parameters)" for a, f in fam.items()}


def _family(path: str) -> str:
  parts = [p for p in path.split("/") if not p.isdigit() and p not in ("runs", "core")]
  return "/".join(parts[-2:]) if len(parts) > 1 else parts[0]


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
  args: tuple               # abstract (params, opt_state, moe_bias, batch)
  out_shardings: tuple
  mesh: jax.sharding.Mesh
  rules: Mapping[str, Any] = dataclasses.field(default_factory=lambda: dict(sharding.RULES))
  graphdef: Any = None      # the model's nnx.GraphDef
  model_cfg: Any = None     # its ModelConfig


def lower_args(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, global_batch: int,
               rules=None) -> Lowered:
  """The train step and its abstract, sharded arguments, built as `launch.train.run` builds them,
  under `rules` (default: the active table)."""
  from launch.step import make_train_step

  rules = dict(sharding.active_rules() if rules is None else rules)
  with sharding.use_rules(rules):
    return _lower_args(cfg, mesh, global_batch, rules, make_train_step)


def _lower_args(cfg, mesh, global_batch, rules, make_train_step) -> Lowered:
  run = setup.run_config(cfg, process_count=1)
  run = dataclasses.replace(run, optim=dataclasses.replace(
      run.optim, tokens_per_step=global_batch * run.data.seq_len))
  state = setup.abstract_state(run, mesh, rules)
  params_s, opt_s, replicated = state.shardings
  batch = abstract_batch(cfg, run.model, global_batch, sharding.batch_sharding(mesh, 1, rules))
  step = make_train_step(run.model, state.graphdef, state.tx, run.optim.moe_bias_gamma)
  return Lowered(step, (*state.arrays(), batch), (params_s, opt_s, replicated, replicated),
                 mesh, rules, state.graphdef, run.model)


def compile_train_step(low: Lowered):
  """Lower and compile (never run) the donated, sharded train step; (compiled, seconds)."""
  t0 = time.perf_counter()
  with jax.set_mesh(low.mesh), sharding.use_rules(low.rules):
    compiled = jax.jit(low.step, donate_argnums=(0, 1, 2),
                       out_shardings=low.out_shardings).lower(*low.args).compile()
  return compiled, time.perf_counter() - t0


def compile_grad_step(low: Lowered):
  """Lower and compile (never run) the gradient of the training objective alone, parameters and
  batch sharded as in `low`: XLA's memory analysis of it is parameters + gradients + activations,
  the part of the plan that `activation_bytes` estimates (the optimizer state is exact by
  construction). (compiled, seconds)."""
  from dsv41_jax.loss import objective
  from launch.step import model_inputs

  params, _, bias, batch = low.args
  gdef, mcfg = low.graphdef, low.model_cfg

  def loss(params, bias, batch):
    logits, aux = nnx.merge(gdef, params)(model_inputs(batch), bias)
    return objective(mcfg, logits, aux, batch)[0]

  t0 = time.perf_counter()
  with jax.set_mesh(low.mesh), sharding.use_rules(low.rules):
    compiled = jax.jit(jax.grad(loss), out_shardings=low.out_shardings[0]).lower(
        params, bias, batch).compile()
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
                  rules=None, devices=None) -> dict[str, Any]:
  devices = list(jax.devices() if devices is None else devices)
  n = math.prod(sizes.values())
  if n > len(devices):
    raise PlanError(f"mesh {_mesh_str(sizes)} needs {n} devices but jax sees {len(devices)}")
  mesh = sharding.make_mesh(sizes, devices[:n])
  low = lower_args(cfg, mesh, global_batch, rules)
  compiled, seconds = compile_train_step(low)
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
  lines.append(f"  mesh {_mesh_str(plan['mesh'])} ({math.prod(plan['mesh'].values())} devices); "
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
  lines.append(f"    gradients      {_gib(plan['grad_bytes'])}")
  lines.append(f"    optimizer      {_gib(plan['opt_bytes'])}   (1 buffer muon/sinkhorn, 2 adamw)")
  act = plan["activation_bytes"]
  lines.append(f"    activations    {_gib(act['total'])}   estimate: carries "
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
         max_compile_params: float = DEFAULT_MAX_COMPILE_PARAMS, name: str = "config"
         ) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
  """The whole tool as a function: (analytic plan, compiled figures or None, printed report)."""
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
  a_plan = analytic_plan(mcfg, sizes, gb, cfg.data.seq_len, rules)
  a_plan["batch_note"] = note
  compiled = None
  reason = ""
  if not analytic and a_plan["total_params"] > max_compile_params:
    reason = (f"  ({a_plan['total_params']:,} parameters > --max_compile_params="
              f"{max_compile_params:.3g}: analytic plan only)")
    analytic = True
  if not analytic:
    c_cfg = ml_collections.ConfigDict(cfg.to_dict())
    c_cfg.data.batch_size = gb
    compiled = compiled_plan(c_cfg, sizes, gb, rules)
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
                      name=_flag(sys.argv, "config") or "config")
  except (PlanError, ConfigError, sharding.ShardingError, setup.SetupError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(text)


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags
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
  flags.mark_flags_as_required(["config", "mesh"])
  app.run(main)
