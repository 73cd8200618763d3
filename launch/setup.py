"""One setup for every entry point (`launch.train`, `launch.aot`, the benchmarks): typed config
sections, the mesh, the train state (sharded arrays, or abstract ones for a plan), the compiled
train step, and the batch adapter that turns a process's host rows into the global batch.

    run = setup.run_config(cfg)                  # every section typed and checked once
    mesh = setup.build_mesh(run.mesh)
    rows = setup.global_batch(run, mesh)         # rows per step, checked against the batch axes
    cmap = setup.compression_map(run.model, tok) # the tokenizer's Engram map, built once
    features = setup.EngramFeatures(run.model, cmap)  # hash ids made in the data pipeline
    ts = setup.init_state(run, mesh)             # or setup.abstract_state(run, mesh) to plan
    adapter = setup.BatchAdapter(run.model, run.data, mesh, cmap)
    step = setup.train_step_jit(run, ts)         # donated, sharded, traced under the mesh
    compiled = setup.compile_train_steps(step, mesh, phases, (ts.state, adapter(rows)),
                                         setup.schedule_input(run, ts))
    # or compiled before the state exists (as launch.train does, beside `init_state`):
    #   ats, args, sched = setup.ahead_args(run, mesh, adapter, rows)
    #   pending = setup.start_train_steps(setup.train_step_jit(run, ats), mesh, phases, args, sched)
    ts.state, metrics = compiled[train_vit](ts.state, adapter(rows))  # one step

Every check here raises `SetupError` whose message starts with the config key it is about
(`config.data.batch_size=0 must be >= 1`, `config.mesh: ...`) and says what to change;
`launch.train` prints it as one `error: ...` line and exits 2.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs.common import MeshConfig, SectionError, TrainConfig, model_config, section
from data import images, packing
from data.config import DataConfig, DataConfigError, data_config, images_per_row
from dsv41_jax import inputs, model as model_lib, sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.vision.merge import check_image_batch
from launch import unfilled_buffers
from launch.step import TrainState, engram_sub_tables, make_eval_step, make_train_step
from optim.chain import build_optimizer, init_opt_state, opt_state_shardings
from optim.config import OptimConfig, optim_config
from optim.schedule import Schedule, schedule_of


class SetupError(ValueError):
  """A config, data or mesh mistake found before training; the message names the key."""


def _message(e: BaseException) -> str:
  return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


# --- typed config ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The five sections of a config as frozen, validated dataclasses."""

  model: ModelConfig
  data: DataConfig
  optim: OptimConfig   # tokens_per_step = global rows × data.seq_len
  train: TrainConfig
  mesh: MeshConfig

  @property
  def tokens_per_step(self) -> int:
    return self.optim.tokens_per_step


def run_config(cfg, process_count: int | None = None) -> RunConfig:
  """Check every section of a ConfigDict, data first (the optimizer's tokens per step derive from
  it); `process_count` (default: jax's) multiplies `data.batch_size` into the global batch."""
  processes = jax.process_count() if process_count is None else process_count
  try:
    data = data_config(cfg.data)
  except DataConfigError as e:
    raise SetupError(f"config.{e}") from None
  try:
    train = section(TrainConfig, cfg.train, "train")
    mesh = section(MeshConfig, cfg.mesh, "mesh")
  except SectionError as e:
    raise SetupError(str(e)) from None
  try:
    model = model_config(cfg)
  except (KeyError, TypeError, ValueError) as e:  # ConfigError names the contradicting fields
    raise SetupError(f"config.model: {_message(e)}") from None
  try:
    optim = optim_config({**dict(cfg.optim),
                          "tokens_per_step": data.batch_size * processes * data.seq_len})
  except (KeyError, TypeError, ValueError) as e:
    raise SetupError(f"config.optim: {_message(e)}") from None
  return RunConfig(model, data, optim, train, mesh)


# --- mesh and batch ----------------------------------------------------------------------------

def build_mesh(mesh_cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
  """The device mesh of the `mesh` section over `devices` (default: all)."""
  try:
    return sharding.make_mesh(dataclasses.asdict(mesh_cfg), devices)
  except ValueError as e:
    raise SetupError(f"config.mesh: {e}") from None


def global_batch(run: RunConfig, mesh, process_count: int | None = None) -> int:
  """Rows per step over all processes; they must split into `train.grad_accum_steps` micro-batches
  that each split evenly over the batch's mesh axes."""
  processes = jax.process_count() if process_count is None else process_count
  rows = run.data.batch_size * processes
  axes, ways = sharding.batch_axes(mesh), sharding.batch_ways(mesh)
  k = run.train.grad_accum_steps
  if rows % (k * ways):
    fits = [d for d in range(1, rows + 1) if rows % (d * ways) == 0]
    unit = k * ways // math.gcd(k * ways, processes)
    raise SetupError(
        f"config.data.batch_size ({run.data.batch_size}) × processes ({processes}) = {rows} rows "
        f"do not split into train.grad_accum_steps ({k}) micro-batches over the mesh's batch axes "
        f"{axes} ({ways} ways): make data.batch_size a multiple of {unit}"
        + (f", or grad_accum_steps one of {fits}" if fits else ""))
  return rows


def compression_map(model: ModelConfig, tok) -> np.ndarray | None:
  """The tokenizer's Engram compression map (built once), checked against the model's vocabulary
  and compressed table size; None for a model without Engram."""
  if tok.vocab_size > model.vocab_size:
    raise SetupError(f"config.model.vocab_size: the tokenizer {tok.source} has {tok.vocab_size} "
                     f"tokens but model.vocab_size is {model.vocab_size}; raise model.vocab_size")
  if not model.engram_layer_ids:
    return None
  from dsv41_jax.engram.compression import build_compression_map
  cmap = build_compression_map(lambda i: tok.decode([i]), tok.vocab_size,
                               raw_token=lambda i: tok.id_to_token(i) or "")
  if int(cmap.max()) + 1 > model.engram_compressed_vocab_size:
    raise SetupError(f"config.model.engram_compressed_vocab_size: the tokenizer compresses to "
                     f"{int(cmap.max()) + 1} ids but model.engram_compressed_vocab_size is "
                     f"{model.engram_compressed_vocab_size}; raise it")
  return cmap


class EngramFeatures:
  """The Engram hash ids as the data pipeline's token features (`data/pipeline.py`): computed per
  document piece where the pieces are made (grain workers), so they travel with the batch under
  "engram_ids" and the train loop does no hashing. Picklable (a model config and the tokenizer's
  compression map, built once by `compression_map`)."""

  name = "engram_ids"

  def __init__(self, model: ModelConfig, cmap: np.ndarray):
    self.model, self.cmap = model, cmap
    self.lookback = model.engram_max_ngram_size - 1  # an n-gram reads n - 1 tokens back

  def __call__(self, tokens_1xL, segment_ids_1xL, dead_1xL) -> dict[int, np.ndarray]:
    return inputs.engram_ids(self.model, tokens_1xL, segment_ids_1xL, dead_1xL, self.cmap)


class BatchAdapter:
  """A process's host rows (numpy, `data/packing.py` keys) → the global batch the step takes.

  One place for: the image-layout check (the model cannot raise inside jit), the Engram hash ids
  per Engram layer when the rows do not carry them already (`EngramFeatures` puts them in the data
  pipeline; else `dsv41_jax.inputs.engram_ids` here, with the tokenizer's compression map), and the
  placement of every array over the batch's mesh axes (`make_array_from_process_local_data`:
  valid with several processes). `abstract(rows)` gives the same batch as ShapeDtypeStructs, for
  compiling without data."""

  def __init__(self, model: ModelConfig, data: DataConfig, mesh, cmap: np.ndarray | None = None,
               rules=None):
    self.model, self.data, self.mesh, self.cmap, self.rules = model, data, mesh, cmap, rules

  def host(self, rows: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The host-side part: checks and Engram ids, still numpy."""
    batch = model_keys(self.model, rows)
    if self.model.vision is not None and "images" in batch:  # the pipeline's rows always do
      check_image_batch(batch, cell_px=images.CELL_PX, max_image_size=self.data.max_image_size)
    if self.model.engram_layer_ids and "engram_ids" not in batch:  # not from the pipeline
      batch["engram_ids"] = inputs.engram_ids(self.model, batch["tokens"], batch["segment_ids"],
                                              batch["image_mask"], self.cmap)
    return batch

  def __call__(self, rows: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return to_global(self.host(rows), self.mesh, self.rules)

  def abstract(self, global_rows: int) -> dict[str, Any]:
    """ShapeDtypeStructs (with shardings) of one global batch of `global_rows` rows."""
    return abstract_batch(self.model, self.data, global_rows,
                          sharding.batch_sharding(self.mesh, 1, self.rules))


def model_keys(model: ModelConfig, rows: Mapping[str, Any]) -> dict[str, Any]:
  """The packed rows' arrays that `model` reads: without a ViT, of the image arrays only
  `image_mask` (the image tokens' positions; the pipeline packs images into every row whatever
  the model, and a text-only step neither needs them on the device nor compiles for them)."""
  if model.vision is not None:
    return dict(rows)
  return {k: v for k, v in rows.items() if not k.startswith("image") or k == "image_mask"}


def abstract_batch(model: ModelConfig, data: DataConfig, global_rows: int,
                   rows_sharding: NamedSharding | None = None) -> dict[str, Any]:
  """ShapeDtypeStructs of one global batch as the adapter makes it: the packed-row keys of
  `data/packing.py` (image arrays only for a model with vision), plus Engram ids per Engram layer;
  split on their leading (row) axis like `rows_sharding`'s first dimension when given."""
  row = packing.empty_row(data.seq_len, images_per_row(data.seq_len, data.max_images_per_row),
                          images.max_cells(data.max_image_size) * images.CELL_PX)
  row = model_keys(model, row)
  shapes = {k: ((global_rows, *np.shape(v)), np.asarray(v).dtype) for k, v in row.items()}
  if model.engram_layer_ids:
    probe = inputs.engram_ids(model, np.zeros((1, 8), np.int32), np.ones((1, 8), np.int32), None,
                              np.arange(model.vocab_size) % model.engram_compressed_vocab_size)
    shapes["engram_ids"] = {l: ((global_rows, data.seq_len, v.shape[-1]), np.dtype(np.int32))
                            for l, v in probe.items()}

  def sds(sd):
    shape, dtype = sd
    s = None
    if rows_sharding is not None:
      s = NamedSharding(rows_sharding.mesh,
                        P(rows_sharding.spec[0], *([None] * (len(shape) - 1))))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=s)
  return jax.tree.map(sds, shapes, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                      and isinstance(x[0], tuple))


def to_global(batch: Mapping[str, Any], mesh, rules=None) -> dict[str, Any]:
  """Per-process numpy rows → global arrays split over the batch's mesh axes (each process
  contributes its own rows; valid with several processes). `rules` None: the active table."""
  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, x.ndim, rules), x)
  return jax.tree.map(put, dict(batch))


def replicate(x, sharding_: NamedSharding) -> jax.Array:
  """A host value as a replicated global array (valid with several processes, unlike
  `jax.device_put` of a process-local array)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding_, lambda index: x[index])


# --- train state -------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainSetup:
  """The train state (`launch.step.TrainState`: arrays, or ShapeDtypeStructs) with what the step
  needs to use it: the same tree of output shardings, the module graph and the optimizer."""

  state: TrainState
  shardings: TrainState  # NamedShardings: params and opt_state as placed, moe_bias replicated
  graphdef: nnx.GraphDef
  tx: Any
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # init_state's parts

  @property
  def replicated(self) -> NamedSharding:
    """The mesh's replicated sharding (MoE biases, metrics, scalars)."""
    return self.shardings.moe_bias

  def checkpoint(self, step) -> dict:
    """The checkpointed tree (`launch.checkpoint`): state plus the step as a replicated int32."""
    return {**self.state._asdict(), "step": replicate(np.int32(step), self.replicated)}

  def restored(self, tree: Mapping[str, Any]) -> None:
    """Take the state of a restored checkpoint tree (`checkpoint`'s layout)."""
    self.state = TrainState(*(tree[k] for k in TrainState._fields))


def init_state(run: RunConfig, mesh) -> TrainSetup:
  """The model and optimizer state created directly with their shardings (seed `train.seed`)."""
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    model = model_lib.init_model(run.model, run.train.seed, mesh)
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  t1 = time.perf_counter()
  tx = build_optimizer(run.optim, params, sub_tables=engram_sub_tables(model))
  del model
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  opt_state = init_opt_state(tx, params, param_shardings)
  replicated = NamedSharding(mesh, P())
  moe_bias = replicate(model_lib.zero_moe_bias(run.model), replicated)
  shardings = TrainState(param_shardings, jax.tree.map(lambda x: x.sharding, opt_state),
                         replicated)
  # Each part is mostly its program's compilation: the programs themselves run asynchronously.
  seconds = {"parameters": t1 - t0, "optimizer state": time.perf_counter() - t1}
  return TrainSetup(TrainState(params, opt_state, moe_bias), shardings, graphdef, tx, seconds)


def abstract_state(run: RunConfig, mesh, rules=None) -> TrainSetup:
  """The same state as ShapeDtypeStructs carrying their shardings under `rules` (no memory)."""
  abs_model = model_lib.abstract_model(run.model)
  graphdef, abs_vars = nnx.split(abs_model)
  shard = nnx.as_pure(sharding.state_shardings(abs_vars, mesh, rules))
  params = nnx.as_pure(abs_vars)
  tx = build_optimizer(run.optim, params, sub_tables=engram_sub_tables(abs_model),
                       param_shardings=shard)
  shardings = TrainState(shard, opt_state_shardings(tx, params, shard), NamedSharding(mesh, P()))
  abstract = TrainState(params, jax.eval_shape(tx.init, params),
                        jax.eval_shape(lambda: model_lib.zero_moe_bias(run.model)))
  with_s = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return TrainSetup(jax.tree.map(with_s, abstract, shardings), shardings, graphdef, tx)


# --- steps -------------------------------------------------------------------------------------

def train_step_jit(run: RunConfig, ts: TrainSetup) -> Callable:
  """The jitted train step of `launch.step`, `(state, batch, train_vit, schedule) -> (state,
  metrics)`: state donated, outputs on the state's shardings, `train_vit` static, so each ViT
  phase is its own program; the learning-rate schedule is an input (`schedule_input`), so one
  program serves every `train.steps` and `optim.lr`. With `train.unfilled_buffers` the step's
  scan stacks and conditional residual slots are left unfilled (`launch.unfilled_buffers`); the
  patch is process-wide, so a config without it takes it out again (benchmarks build several
  configs' steps in one process, each lowered before the next is built)."""
  if run.train.unfilled_buffers:
    unfilled_buffers.install()
  else:
    unfilled_buffers.uninstall()
  return jax.jit(make_train_step(run.model, ts.graphdef, ts.tx, run.optim.moe_bias_gamma,
                                 run.train.grad_accum_steps),
                 donate_argnums=(0,), static_argnums=(2,),
                 out_shardings=(ts.shardings, ts.replicated))


def schedule_input(run: RunConfig, ts: TrainSetup) -> Schedule:
  """The run's learning-rate schedule as the train step's input: replicated float32 scalars."""
  return Schedule(*(replicate(v, ts.replicated) for v in schedule_of(run.optim)))


class Compiling:
  """Train-step programs compiling on worker threads, one per `train_vit` phase (XLA compiles
  outside the GIL; `start_train_steps` returns at once). `wait` blocks until they are built.
  `in_order`: one thread, the phases one after another in the order given (the first phase's
  program is then ready as soon as it would be alone; the next compiles while it trains)."""

  def __init__(self, jitted, mesh, phases, args, schedule: Schedule | None = None,
               in_order: bool = False):
    extra = () if schedule is None else (schedule,)

    def one(train_vit):
      with jax.set_mesh(mesh):
        return jitted.lower(*args, train_vit, *extra).compile()

    self.args = (*args, *extra)   # what the programs were compiled for (arrays or abstract)
    self._pool = ThreadPoolExecutor(1 if in_order else len(phases))
    self._futures = {tv: self._pool.submit(one, tv) for tv in phases}
    self._pool.shutdown(wait=False)  # no new work; the threads end with their compilation

  def holds(self, train_vit: bool) -> bool:
    return train_vit in self._futures

  def wait(self, poll: Callable[[], None] | None = None, only=None) -> dict[bool, Any]:
    """The compiled programs by phase (of the phases in `only`, if given). The main thread only
    waits, so a signal handler runs at once, and `poll` is called every 0.2 s of the wait: it may
    raise to abandon the compilation (abandoned, not awaited: the caller exits without joining
    the threads)."""
    futures = {tv: f for tv, f in self._futures.items() if only is None or tv in only}
    pending = set(futures.values())
    try:
      while pending:
        pending = wait(pending, timeout=0.2).not_done
        if poll is not None:
          poll()
      return {tv: f.result() for tv, f in futures.items()}
    except BaseException:
      for f in self._futures.values():
        f.cancel()
      raise


def start_train_steps(jitted, mesh, phases, args, schedule: Schedule | None = None,
                      in_order: bool = False) -> Compiling:
  """Start the AOT compilation of the train step for each `train_vit` phase; with the persistent
  cache a rerun loads them instead. With `schedule`, each program takes it after `args`: called
  as `compiled(*args, schedule)`. `args` may be ShapeDtypeStructs with shardings (`ahead_args`).
  `in_order`: one after another, in the order of `phases` (see `Compiling`)."""
  return Compiling(jitted, mesh, phases, args, schedule, in_order)


def compile_train_steps(jitted, mesh, phases, args, schedule: Schedule | None = None, *,
                        poll: Callable[[], None] | None = None) -> dict[bool, Any]:
  """`start_train_steps(...).wait(poll)`: the compiled programs by phase, concurrently."""
  return start_train_steps(jitted, mesh, phases, args, schedule).wait(poll)


def device_memory(mesh) -> float | None:
  """Bytes one of this process's devices of `mesh` gives a program (its allocator's limit:
  XLA_PYTHON_CLIENT_MEM_FRACTION of a GPU's memory), or None where the backend does not say (the
  CPU). A device of another process cannot be asked: the first local one is."""
  stats = mesh.local_devices[0].memory_stats() or {}
  return float(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def _size(b: float) -> str:
  return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


# The analytic plan's largest over-estimate seen on the H200 (s3 at 4 × 4,096 without accumulation,
# 1.09 with the kernels and with the XLA forms, RESULTS.md session 51): before compiling, a step
# is stopped only when its plan exceeds the device by more than that, so that no step that would
# fit is stopped on the estimate's account; the compiled program's check catches the rest.
PLAN_OVER_ESTIMATE = 1.10


def plan_shortfall(run: RunConfig, mesh, rows: int, device_bytes: float | None) -> str | None:
  """None when the analytic memory plan of the train step (`launch.memory_plan.analytic_plan` for
  this mesh's platform) is within PLAN_OVER_ESTIMATE × `device_bytes` (None: unknown, no check),
  else one message: its estimate, what the device gives, and the smallest
  `train.grad_accum_steps` whose plan fits the device. Asked before anything compiles, so a step
  far over the device's memory costs no compile. The plan is an estimate (0.85-1.09 of eight H200
  programs, docs/user_guide.md §8); the compiled program is checked again (`memory_shortfall`)."""
  from launch import memory_plan
  if device_bytes is None:
    return None
  k, ways = run.train.grad_accum_steps, sharding.batch_ways(mesh)
  backend = mesh.devices.flat[0].platform
  sizes = dict(mesh.shape)

  def need(k2: int) -> float:
    return memory_plan.analytic_plan(run.model, sizes, rows, run.data.seq_len,
                                     chain=run.optim.chain, grad_accum_steps=k2,
                                     backend=backend)["total_bytes"]
  try:
    total = need(k)
  except memory_plan.PlanError:
    return None
  if total <= PLAN_OVER_ESTIMATE * device_bytes:
    return None
  advice = ("no micro-batch of whole rows fits the estimate: shard the model over more devices "
            "(mesh.fsdp, mesh.expert) or use fewer rows a step")
  for k2 in range(k + 1, rows // ways + 1):
    if rows % (k2 * ways) == 0 and (fits := need(k2)) <= device_bytes:
      advice = (f"train.grad_accum_steps={k2} ({rows // (k2 * ways)} rows a micro-batch per "
                f"device, the same {rows}-row step) is estimated at {_size(fits)}")
      break
  return (f"the memory plan estimates the train step at {_size(total)} a device "
          f"({rows // (k * ways)} rows a micro-batch per device, train.grad_accum_steps={k}; "
          f"`python -m launch.aot --analytic --backend={backend}` prints its terms), more than the "
          f"{_size(device_bytes)} the device gives it; {advice}; or train.memory_check=False to "
          "compile it anyway")


def memory_shortfall(compiled, run: RunConfig, mesh, rows: int, param_bytes: float,
                     device_bytes: float | None) -> str | None:
  """None when the compiled train step's peak per device fits `device_bytes` (None: unknown, no
  check), else one message: what it needs, what the device gives, and the smallest
  `train.grad_accum_steps` that would fit. The peak is XLA's own account of the compiled program
  (`memory_analysis`: arguments + outputs − donated + temporaries); the suggestion scales the
  temporaries with the micro-batch's rows and adds a float32 gradient accumulator of `param_bytes`
  (the parameters' bytes per device) where there was none: an estimate, said so."""
  if device_bytes is None:
    return None
  m = compiled.memory_analysis()
  if m is None:
    return None
  fixed = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  need = fixed + m.temp_size_in_bytes
  if need <= device_bytes:
    return None
  gib = _size
  k, ways = run.train.grad_accum_steps, sharding.batch_ways(mesh)
  advice = ("not even one row a micro-batch would fit: shard the model over more devices "
            "(mesh.fsdp, mesh.expert) or use fewer rows a step")
  for k2 in range(k + 1, rows // ways + 1):
    if rows % (k2 * ways):
      continue
    guess = fixed + m.temp_size_in_bytes * k / k2 + (param_bytes if k == 1 else 0.0)
    if guess <= device_bytes:
      advice = (f"train.grad_accum_steps={k2} ({rows // (k2 * ways)} rows a micro-batch per "
                f"device, the same {rows}-row step) would need ~{gib(guess)} by scaling the "
                "temporaries with the rows (an estimate)")
      break
  return (f"the train step needs {gib(need)} a device (XLA's memory analysis of the compiled "
          f"program: arguments {gib(m.argument_size_in_bytes)}, outputs "
          f"{gib(m.output_size_in_bytes)}, donated {gib(m.alias_size_in_bytes)}, temporaries "
          f"{gib(m.temp_size_in_bytes)}), more than the {gib(device_bytes)} the device gives it "
          f"({rows // (k * ways)} rows a micro-batch per device, train.grad_accum_steps={k}); "
          f"{advice}; or train.memory_check=False to run it anyway")


def ahead_args(run: RunConfig, mesh, adapter: BatchAdapter, global_rows: int
               ) -> tuple[TrainSetup, tuple[Any, ...], Schedule]:
  """What the train step is compiled for before any array exists: the abstract state (its own
  graphdef and optimizer, the same program as `init_state`'s), (state, batch) as
  ShapeDtypeStructs with shardings, and the schedule's replicated scalars likewise."""
  ts = abstract_state(run, mesh)
  scalar = jax.ShapeDtypeStruct((), np.float32, sharding=ts.replicated)
  return ts, (ts.state, adapter.abstract(global_rows)), Schedule(
      *(scalar for _ in schedule_of(run.optim)))


def signature_mismatch(compiled_for, args) -> str | None:
  """None when `args` (arrays) have the shapes, dtypes, weak types and shardings that
  `compiled_for` (ShapeDtypeStructs or arrays) describe, leaf for leaf; else the first
  difference, as a path and both descriptions. A program compiled ahead is called only with
  arguments it was compiled for."""
  def describe(x):
    weak = x.aval.weak_type if hasattr(x, "aval") else bool(getattr(x, "weak_type", False))
    return tuple(np.shape(x)), np.dtype(x.dtype), weak

  def placed_alike(x, y) -> bool:
    sx, sy = getattr(x, "sharding", None), getattr(y, "sharding", None)
    return (sx is None) == (sy is None) and (sx is None or sx.is_equivalent_to(sy, np.ndim(x)))
  a, b = jax.tree.leaves_with_path(compiled_for), jax.tree.leaves_with_path(args)
  if jax.tree.structure(compiled_for) != jax.tree.structure(args):
    return (f"tree structure: {len(a)} leaves compiled for, {len(b)} given "
            f"({jax.tree.structure(compiled_for)} vs {jax.tree.structure(args)})")[:500]
  for (path, x), (_, y) in zip(a, b):
    if describe(x) != describe(y):
      return f"{jax.tree_util.keystr(path)}: {describe(x)} compiled for, {describe(y)} given"
    if not placed_alike(x, y):
      return (f"{jax.tree_util.keystr(path)}: sharding {getattr(x, 'sharding', None)} compiled "
              f"for, {getattr(y, 'sharding', None)} given")
  return None


def eval_step(run: RunConfig, ts: TrainSetup, mesh) -> Callable:
  """(params, moe_bias, batch, token_bytes) → (sum of nats, tokens, bytes), traced under the mesh
  so the model's sharding constraints and parallel MoE / Engram paths apply."""
  jitted = jax.jit(make_eval_step(run.model, ts.graphdef), out_shardings=ts.replicated)

  def call(*args):
    with jax.set_mesh(mesh):
      return jitted(*args)
  return call
