"""The main job: sharded pre-training with logs, checkpoints, exact resume and evaluation.

  python -m launch.train --config=configs/tiny.py --workdir=/tmp/dsv41_tiny
  python -m launch.train --config=configs/tiny.py --workdir=DIR --config.train.steps=50 \
      --config.mesh.data=2 --config.mesh.expert=4

Multi-host: pass --coordinator_address=host:port --num_processes=N --process_id=i (or set
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; on SLURM, jax detects them). Every
process reads its own data shard; `data.batch_size` rows per process make one global batch.

A work directory that holds a checkpoint is resumed from it (on any mesh shape). SIGTERM saves a
checkpoint and exits 0. A step with a non-finite loss, gradient or update is not applied; after
`train.max_bad_steps` such steps in a row the run stops, the last good checkpoint intact.
Configuration mistakes (unknown key, mesh vs devices, batch vs data axes, a work directory of
another model) stop before the first step with `error: ...` and exit status 2.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import config_flags

from configs.common import model_config
from data import images
from data.pipeline import make_eval_iterator, make_tokenizer, make_train_iterator
from dsv41_jax import flops, inputs, model as model_lib, sharding
from dsv41_jax.engram.compression import build_compression_map
from dsv41_jax.vision.merge import check_image_batch
from launch import checkpoint as ckpt_lib
from launch import compile_cache, evaluation, metrics as metrics_lib, xla_flags
from launch.step import engram_sub_tables, make_eval_step, make_train_step
from optim.chain import build_optimizer, frozen_trainable, init_opt_state, learning_rates
from optim.config import optim_config

log = logging.getLogger("dsv41.train")

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory (logs, checkpoints).")
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", None, "This process's id (multi-host).")

BATCH_AXES = ("batch",)


class TrainingError(RuntimeError):
  """The run cannot continue; the message says what to change."""


def init_distributed(coordinator: str | None, num_processes: int | None,
                     process_id: int | None) -> None:
  """`jax.distributed.initialize` from flags, else the environment; no-op for one process."""
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = num_processes or _int_env("JAX_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _int_env("JAX_PROCESS_ID")
  if coordinator and num_processes and num_processes > 1:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
  elif "SLURM_NTASKS" in os.environ and int(os.environ["SLURM_NTASKS"]) > 1:
    jax.distributed.initialize()


def _int_env(name: str) -> int | None:
  v = os.environ.get(name)
  return int(v) if v else None


def _message(e: BaseException) -> str:
  return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def build_mesh(cfg: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  try:
    return sharding.make_mesh(dict(cfg.mesh))
  except ValueError as e:
    raise TrainingError(f"config.mesh: {e}") from None


def check_batch(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> int:
  """Global batch size; it must split evenly over the mesh axes the batch is sharded on."""
  global_batch = cfg.data.batch_size * jax.process_count()
  spec = sharding.logical_to_mesh(BATCH_AXES)
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  ways = int(np.prod([mesh.shape[a] for a in axes if a]))
  if global_batch % ways:
    raise TrainingError(
        f"data.batch_size ({cfg.data.batch_size}) × processes ({jax.process_count()}) = "
        f"{global_batch} rows do not split over the mesh's batch axes {axes} ({ways} ways); make "
        f"data.batch_size a multiple of {ways // math.gcd(ways, jax.process_count())}")
  return global_batch


def replicate(x, sharding: NamedSharding) -> jax.Array:
  """A host value as a replicated global array (valid with several processes, unlike
  `jax.device_put` of a process-local array)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def batch_digest(batch: dict[str, np.ndarray]) -> str:
  """sha256 (first 16 hex digits) of a host batch's tokens: which data a process saw."""
  import hashlib
  return hashlib.sha256(np.ascontiguousarray(batch["tokens"]).tobytes()).hexdigest()[:16]


def to_global(batch: dict[str, np.ndarray], mesh) -> dict[str, Any]:
  """Per-process numpy rows → global arrays sharded over the batch axes."""
  spec = sharding.logical_to_mesh(BATCH_AXES)

  def put(x):
    x = np.asarray(x)
    s = NamedSharding(mesh, P(spec[0], *([None] * (x.ndim - 1))))
    return jax.make_array_from_process_local_data(s, x)

  return jax.tree.map(put, batch)


class _Stop:
  """SIGTERM sets a flag the loop reads after the step in flight.

  With several processes they must stop after the same step (the save is collective), so
  `agreed()` asks every process and stops all of them when any one was signalled."""

  def __init__(self):
    self.requested = False
    self._old = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    self.requested = True

  def agreed(self) -> bool:
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils
    return bool(np.max(multihost_utils.process_allgather(np.int32(self.requested))))

  def restore(self):
    signal.signal(signal.SIGTERM, self._old)


def _under_mesh(mesh, fn):
  def call(*args):
    with jax.set_mesh(mesh):
      return fn(*args)
  return call


def run(cfg: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train per `cfg` in `workdir`; returns a summary (last losses, steps run, eval figures).

  The SIGTERM handler is installed first, so a SIGTERM during start-up (data, compilation)
  also ends in a saved checkpoint and a clean exit, after the first step."""
  stop = _Stop()
  try:
    return _run(cfg, workdir, stop)
  finally:
    stop.restore()


def compile_train_steps(jitted, mesh, phases, args) -> dict[bool, Any]:
  """AOT-compile the train step for each `train_vit` phase the run will see, concurrently (XLA
  compiles outside the GIL); with the persistent cache a rerun loads them instead."""
  from concurrent.futures import ThreadPoolExecutor

  def one(train_vit):
    with jax.set_mesh(mesh):
      return jitted.lower(*args, train_vit).compile()

  with ThreadPoolExecutor(len(phases)) as pool:
    futures = {tv: pool.submit(one, tv) for tv in phases}
    return {tv: f.result() for tv, f in futures.items()}


def _run(cfg: ml_collections.ConfigDict, workdir: str, stop: _Stop) -> dict[str, Any]:
  t_start = time.time()
  cache_dir = compile_cache.enable(cfg.train.get("compilation_cache_dir", ""))
  try:
    mcfg = model_config(cfg)
  except (KeyError, ValueError) as e:  # ConfigError names the contradicting fields
    raise TrainingError(f"config.model: {_message(e)}") from None
  mesh = build_mesh(cfg)
  global_batch = check_batch(cfg, mesh)
  log.info("mesh %s over %d devices, %d process(es); global batch %d rows",
           dict(mesh.shape), mesh.size, jax.process_count(), global_batch)
  tcfg = cfg.train
  try:
    ocfg = optim_config({**dict(cfg.optim),
                         "tokens_per_step": global_batch * cfg.data.seq_len})
  except (KeyError, ValueError) as e:
    raise TrainingError(f"config.optim: {_message(e)}") from None
  primary = jax.process_index() == 0
  ckpt_lib.check_or_write_config(workdir, cfg.to_dict(), primary)

  # --- data ---
  try:
    tok = make_tokenizer(cfg)
  except (KeyError, ValueError) as e:
    raise TrainingError(f"config.data / model.vocab_size: {_message(e)}") from None
  if tok.vocab_size > mcfg.vocab_size:
    raise TrainingError(f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size is "
                        f"{mcfg.vocab_size}; raise model.vocab_size")
  cmap = build_compression_map(lambda i: tok.decode([i]), tok.vocab_size,
                               raw_token=lambda i: tok._tok.id_to_token(i) or "")
  if mcfg.engram_layer_ids and int(cmap.max()) + 1 > mcfg.engram_compressed_vocab_size:
    raise TrainingError(f"the tokenizer compresses to {int(cmap.max()) + 1} ids but "
                        f"model.engram_compressed_vocab_size is {mcfg.engram_compressed_vocab_size}")
  try:
    train_it = make_train_iterator(cfg, jax.process_index(), jax.process_count(), tokenizer=tok)
  except (KeyError, ValueError) as e:  # the data section's checks name the field
    raise TrainingError(f"config.data: {_message(e)}") from None
  t_data = time.time()
  token_bytes = replicate(evaluation.token_byte_lengths(tok, mcfg.vocab_size),
                          NamedSharding(mesh, P()))

  def prepare(batch):
    batch = dict(batch)
    if mcfg.vision is not None:  # the model cannot raise inside jit: check the image layout here
      check_image_batch(batch, cell_px=images.CELL_PX, max_image_size=cfg.data.max_image_size)
    if mcfg.engram_layer_ids:
      batch["engram_ids"] = inputs.engram_ids(mcfg, batch["tokens"], batch["segment_ids"],
                                              batch["image_mask"], cmap)
    return to_global(batch, mesh)

  # --- model and optimizer, created directly with their shardings ---
  with jax.set_mesh(mesh):
    model = model_lib.init_model(mcfg, tcfg.seed, mesh)
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  tx = build_optimizer(ocfg, params, sub_tables=engram_sub_tables(model))
  del model
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  opt_state = init_opt_state(tx, params, param_shardings)
  replicated = NamedSharding(mesh, P())
  moe_bias = replicate(model_lib.zero_moe_bias(mcfg), replicated)

  checkpointer = ckpt_lib.Checkpointer(workdir, tcfg.keep_checkpoints)
  start = 0
  restored = checkpointer.restore_latest(
      ckpt_lib.abstract_like({"params": params, "opt_state": opt_state, "moe_bias": moe_bias,
                              "step": replicate(np.int32(0), replicated)}),
      train_it)
  if restored is not None:
    start, state = restored
    params, opt_state, moe_bias = state["params"], state["opt_state"], state["moe_bias"]
    log.info("resumed from step %d of %s", start, checkpointer.directory)
  t_state = time.time()
  log.info("startup: config and data %.1f s, model and optimizer state %.1f s",
           t_data - t_start, t_state - t_data)

  # Both steps trace under the mesh, so the model's sharding constraints apply and the MoE and
  # Engram lookups run their expert- and engram-parallel shard_map paths.
  train_jit = jax.jit(
      make_train_step(mcfg, graphdef, tx, ocfg.moe_bias_gamma), donate_argnums=(0, 1, 2),
      static_argnums=(4,),
      out_shardings=(param_shardings, jax.tree.map(lambda x: x.sharding, opt_state), replicated,
                     replicated))

  def train_vit_at(step: int) -> bool:
    """The ViT trains only once unfrozen (optim.frozen / unfreeze_at): one program per phase."""
    return not ocfg.frozen or frozen_trainable(ocfg, step)

  first_batch = None
  train_steps: dict[bool, Any] = {}
  compile_s = 0.0
  if start < tcfg.steps:
    first_batch = next(train_it)
    log.info("process %d: first batch at step %d: %d rows, tokens sha256 %s",
             jax.process_index(), start + 1, len(first_batch["tokens"]), batch_digest(first_batch))
    first_batch = prepare(first_batch)
    phases = sorted({train_vit_at(start), train_vit_at(tcfg.steps - 1)})
    t0 = time.perf_counter()
    train_steps = compile_train_steps(train_jit, mesh, phases,
                                      (params, opt_state, moe_bias, first_batch))
    compile_s = time.perf_counter() - t0
    log.info("train step compiled in %.1f s (%s; compilation cache: %s)", compile_s,
             " and ".join("ViT trainable" if tv else "ViT frozen" for tv in phases)
             if mcfg.vision is not None else "text only", cache_dir or "off")
  eval_step = _under_mesh(mesh, jax.jit(make_eval_step(mcfg, graphdef), out_shardings=replicated))

  writer = metrics_lib.MetricWriter(workdir, primary)
  flops_per_token = flops.train_flops_per_token(mcfg.replace(seq_len=cfg.data.seq_len))
  peak = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind,
                                           tcfg.peak_flops_per_device)
  tokens_per_step = global_batch * cfg.data.seq_len
  bar = None
  if primary and tcfg.progress_bar:
    from tqdm import tqdm
    bar = tqdm(total=tcfg.steps, initial=start, dynamic_ncols=True, file=sys.stderr)

  def save(step):
    state = {"params": params, "opt_state": opt_state, "moe_bias": moe_bias,
             "step": replicate(np.int32(step), replicated)}
    checkpointer.save(step, state, train_it)

  losses: dict[int, float] = {}
  bad_in_a_row = 0
  last_eval: dict[str, float] = {}
  step = start
  saved = start if restored is not None else None
  window_t, window_wait, window_steps = 0.0, 0.0, 0
  try:
    while step < tcfg.steps:
      t0 = time.perf_counter()
      if first_batch is not None:
        batch, first_batch = first_batch, None
      else:
        batch = prepare(next(train_it))
      t1 = time.perf_counter()
      params, opt_state, moe_bias, m = train_steps[train_vit_at(step)](
          params, opt_state, moe_bias, batch)
      finite = bool(m["finite"])
      t2 = time.perf_counter()
      step += 1
      window_t += t2 - t0
      window_wait += t1 - t0
      window_steps += 1
      loss = float(m["loss"])
      losses[step] = loss
      if finite:
        bad_in_a_row = 0
      else:
        bad_in_a_row += 1
        log.warning("step %d: non-finite loss %s, gradient norm %s or update norm %s; update "
                    "skipped", step, loss, float(m["grad_norm"]), float(m["update_norm"]))
      if step % tcfg.log_every == 0 or step == tcfg.steps:
        step_time = window_t / window_steps
        tps = tokens_per_step / step_time
        record = {k: np.asarray(v) for k, v in m.items()}
        record.update(step_time=step_time, data_wait=window_wait / window_steps,
                      compute_time=(window_t - window_wait) / window_steps,
                      tokens_per_second=tps, tokens_seen=step * tokens_per_step)
        u = metrics_lib.mfu(flops_per_token, tps, jax.device_count(), peak)
        if u is not None:
          record["mfu"] = u
        record["lr"] = learning_rates(ocfg, step)
        record["data"] = train_it.counters()
        record["data"]["padding_fraction"] = (
            record["data"].get("padding_tokens", 0)
            / max(1, record["data"].get("rows", 0) * cfg.data.seq_len))
        writer.write(step, record)
        log.info("process %d step %d loss %r step_time %.3f s (data wait %.3f s)",
                 jax.process_index(), step, loss, step_time, record["data_wait"])
        if bar is not None:
          bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", step_s=f"{step_time:.3f}",
                          **({"mfu": f"{u:.2%}"} if u is not None else {}))
        window_t, window_wait, window_steps = 0.0, 0.0, 0
      if bar is not None:
        bar.update(1)
      if bad_in_a_row >= tcfg.max_bad_steps:  # after the step's metrics are logged
        raise TrainingError(
            f"{bad_in_a_row} consecutive steps had a non-finite loss or gradient (last at step "
            f"{step}); stopping. The last good checkpoint is intact in {checkpointer.directory}"
            f" (steps {checkpointer.steps()}); lower optim.lr or check the data.")
      if tcfg.eval_every and (step % tcfg.eval_every == 0 or step == tcfg.steps):
        last_eval = evaluation.evaluate(
            lambda b: eval_step(params, moe_bias, prepare(b), token_bytes),
            make_eval_iterator(cfg, jax.process_index(), jax.process_count(), tokenizer=tok),
            tcfg.eval_batches)
        writer.write(step, {f"eval/{k}": v for k, v in last_eval.items()})
        log.info("step %d eval %s", step, last_eval)
      stopping = stop.agreed()
      if finite and (step % tcfg.checkpoint_every == 0 or step == tcfg.steps or stopping):
        save(step)
        saved = step
      if stopping:
        if saved == step:
          log.warning("SIGTERM: saved step %d, exiting", step)
        else:
          log.warning("SIGTERM: step %d was not finite and is not saved (last checkpoint: %s); "
                      "exiting", step, saved)
        break
  finally:
    checkpointer.close()
    writer.close()
    if bar is not None:
      bar.close()
  return {"start_step": start, "end_step": step, "losses": losses, "eval": last_eval,
          "seconds": time.time() - t_start, "compile_seconds": compile_s, "params": params,
          "moe_bias": moe_bias}


def main(argv):
  del argv
  # absl owns the root logger (set to WARNING: orbax logs every save at INFO); this job's own
  # logger ("dsv41.*") gets a handler of its own at INFO.
  absl_logging.set_verbosity(absl_logging.WARNING)
  ours = logging.getLogger("dsv41")
  if not ours.handlers:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    ours.addHandler(handler)
  ours.setLevel(logging.INFO)
  ours.propagate = False
  xla_flags.apply_defaults()   # before the first jax call starts the backend
  init_distributed(_COORD.value, _NPROC.value, _PID.value)
  try:
    summary = run(_CONFIG.value, _WORKDIR.value)
  except (TrainingError, ckpt_lib.WorkdirMismatch, ckpt_lib.RestoreError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  losses = summary["losses"]
  last = losses[max(losses)] if losses else float("nan")
  print(f"done (process {jax.process_index()}): steps {summary['start_step']}→"
        f"{summary['end_step']}, last loss {last:.4f}, eval {summary['eval']}, "
        f"{summary['seconds']:.0f} s")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a one-line message (not a traceback) for a bad --config override."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # ml_collections raises these for an unknown key ('stepz' ... Did you mean "steps"?).
    text = " ".join(str(e).replace("\\n", " ").replace("\\'", "'").strip("'\" ").split())
    text = re.sub(r"^([^'\s]+)' ", r"'\1' ", text)  # "'stepz' Did you mean ..."
    given = " ".join(a for a in argv[1:] if a.startswith("--config."))
    print(f"error: a --config override does not fit the config file: {text} (overrides given: "
          f"{given}); fix the key or value", file=sys.stderr)
  sys.exit(2)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=parse_flags)
