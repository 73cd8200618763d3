"""The main job: sharded pre-training with logs, checkpoints, exact resume and evaluation.

  python -m launch.train --config=configs/tiny.py --workdir=/tmp/dsv41_tiny
  python -m launch.train --config=configs/tiny.py --workdir=DIR --config.train.steps=50 \
      --config.mesh.data=2 --config.mesh.expert=4
  python -m launch.train --config=configs/tiny.py --workdir=DIR --profile_steps=5:7

Multi-host: pass --coordinator_address=host:port --num_processes=N --process_id=i (or set
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; on SLURM, jax detects them). Every
process reads its own data shard; `data.batch_size` rows per process make one global batch.

Wiring lives in `launch/setup.py` (typed config, mesh, state, compiled step, batch adapter), the
logged figures, the bar and the summary in `launch/progress.py`, the log file in
`launch/run_log.py`; this file is the loop around them and what a person at the terminal meets:

* Interruptions. SIGTERM or Ctrl-C (SIGINT) in the loop: the step in flight finishes, a
  checkpoint is saved, exit 0; a second Ctrl-C exits at once (status 130) without waiting for the
  save. During start-up or compilation, either signal stops the run at once (exit 0): nothing was
  trained, nothing is saved, the work directory is as it was.
* Nothing is written to the work directory (config.json, checkpoints/, metrics, TensorBoard,
  train.log) before the first step is certain to start, i.e. until the train step is compiled: a
  start that fails or is interrupted leaves it as it was, a finished run started again too. (A
  damaged newest checkpoint is still moved aside to `damaged-<step>` when an older one restores.)
* Errors. Configuration, file-system and input mistakes (unknown key, bad value, mesh vs devices,
  batch vs data axes, missing data or tokenizer file, a work directory that is not writable or
  holds another model, a checkpoint save that fails on a full disk, a train step over the
  device's memory by the analytic plan before compiling or by XLA once compiled:
  `train.memory_check`) stop with one `error: ...` line naming the key or
  path and exit status 2; the last good checkpoint stays.
* Non-finite steps are not applied; after `train.max_bad_steps` in a row the run stops (exit 2).
* Output. A progress bar when stderr is a terminal (its ETA and tokens/s start after
  compilation; warnings are written around it, the per-step lines only to train.log), plain log
  lines otherwise; every log line also in WORKDIR/train.log (`launch/run_log.py`), with the
  detail of what the libraries report (a damaged checkpoint's tracebacks) kept off the terminal;
  `metrics.jsonl` and TensorBoard always (W&B with `train.wandb_project`); an end-of-run summary
  (`format_summary`), skipped records and truncated documents counted in both.
* Resume. A work directory that holds a checkpoint is resumed from it (on any mesh shape); the
  records of steps after the restored one (a run lost after its last checkpoint) leave
  metrics.jsonl and TensorBoard, so each step is logged once. A resume whose config changes the
  learning-rate schedule (a new `train.steps` moves a fractional decay) warns with the next
  step's rate under the old and the new schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from data.lookahead import Lookahead
from data.pipeline import make_eval_iterator, make_tokenizer, make_train_iterator
from launch import checkpoint as ckpt_lib
from launch import cli, compile_cache, evaluation, metrics as metrics_lib, setup, xla_flags
from launch.progress import STEP_LOG, Progress, format_summary
from launch.run_log import RunLog
from launch.cli import parse_flags  # noqa: F401 -- launch.train.parse_flags, as before
from launch.setup import SetupError, compile_train_steps, replicate, to_global  # noqa: F401
from optim import schedule
from optim.config import optim_config
from optim.chain import frozen_trainable

log = logging.getLogger("dsv41.train")

# A wait for the step's metrics shorter than this means the device had finished before the host
# did (the look-ahead's time then counts as data wait).
_DEVICE_DONE_S = 1e-3

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory (logs, checkpoints).")
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", None, "This process's id (multi-host).")
_PROFILE = flags.DEFINE_string(
    "profile_steps", None, "N:M: a jax.profiler trace of steps N..M (1-based, inclusive) into "
    "WORKDIR/profile (TensorBoard's profile plugin or Perfetto read it).")


class TrainingError(RuntimeError):
  """The run cannot continue; the message says what to change."""


class Interrupted(BaseException):
  """A signal during start-up or compilation: stop now, nothing to save. A BaseException, so no
  `except Exception` on the way (a checkpoint restore's fallback, say) mistakes it for a fault."""


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


def batch_digest(batch: dict[str, np.ndarray]) -> str:
  """sha256 (first 16 hex digits) of a host batch's tokens: which data a process saw."""
  import hashlib
  return hashlib.sha256(np.ascontiguousarray(batch["tokens"]).tobytes()).hexdigest()[:16]


def parse_profile_steps(text: str | None, steps: int) -> tuple[int, int] | None:
  """'N:M' → (N, M) with 1 <= N <= M <= steps; None for no profile."""
  if not text:
    return None
  m = re.fullmatch(r"(\d+):(\d+)", text.strip())
  if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
    raise TrainingError(f"--profile_steps={text} must be N:M with 1 <= N <= M (steps to trace, "
                        "1-based, inclusive)")
  first, last = int(m.group(1)), int(m.group(2))
  if last > steps:
    raise TrainingError(f"--profile_steps={text} ends after train.steps = {steps}")
  return first, last


def _data_error(e: BaseException) -> str:
  """A data-pipeline error as `config.data...: ...` (its message names the key or the path)."""
  text = setup._message(e)
  return f"config.{text}" if text.startswith("data.") else f"config.data: {text}"


def check_workdir(workdir: str) -> None:
  """The work directory is writable, or can be created (its nearest existing parent is a
  writable directory); checked before any work, leaving no trace."""
  if not workdir:
    raise TrainingError("--workdir is empty; give a directory for logs and checkpoints")
  there = os.path.abspath(workdir)
  while not os.path.exists(there):
    there = os.path.dirname(there)
  probe = os.path.join(there, f".write-test-{os.getpid()}")
  try:
    if not os.path.isdir(there):
      raise NotADirectoryError(f"{there} is not a directory")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise TrainingError(f"--workdir {workdir} is not writable ({e.strerror or e}); choose a "
                        "directory you can write to") from None


class _Stop:
  """SIGTERM and SIGINT (Ctrl-C), both ways a run is asked to stop.

  Before the loop (`in_loop` False) a signal raises `Interrupted` where the main thread is (the
  compilation runs in worker threads, so the main thread is waiting and reacts at once), unless
  the main thread is in a gc callback (jax runs one at every collection), where Python would
  print the exception as "Exception ignored in gc callback" and drop it: there it is only noted,
  and `check()` raises it at the next start-up point (the compilation's wait polls it). In the
  loop it sets a flag read after the step in flight: save, then exit 0. A second SIGINT (a second
  Ctrl-C) exits at once; a SIGINT after a SIGTERM does not (a supervisor that sends both, e.g.
  `timeout`'s group SIGINT after a SIGTERM, still gets the checkpoint). With several processes they must stop after the same step (the save is collective), so
  `agreed()` asks every process and stops all of them when any one was signalled."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested: str | None = None
    self.in_loop = False
    self._sigints = 0
    self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      self._sigints += 1
    if self._sigints > 1 and signum == signal.SIGINT:
      sys.stderr.write(f"\n{name} again: exiting now, without waiting for the checkpoint\n")
      sys.stderr.flush()
      os._exit(130)
    self.requested = name
    if not self.in_loop and not _in_gc_callback(frame):
      raise Interrupted(name)

  def check(self) -> None:
    """Raise `Interrupted` if a signal came before the loop (one noted in a gc callback)."""
    if self.requested is not None and not self.in_loop:
      raise Interrupted(self.requested)

  def agreed(self) -> bool:
    if jax.process_count() == 1:
      return self.requested is not None
    from jax.experimental import multihost_utils
    asked = np.int32(self.requested is not None)
    return bool(np.max(multihost_utils.process_allgather(asked)))

  def restore(self):
    for s, old in self._old.items():
      signal.signal(s, old)


def _in_gc_callback(frame) -> bool:
  """Whether `frame` (a signal handler's) is inside one of `gc.callbacks`, which swallow what
  they raise."""
  codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  while frame is not None:
    if frame.f_code in codes:
      return True
    frame = frame.f_back
  return False


def run(cfg: ml_collections.ConfigDict, workdir: str, profile_steps: str | None = None
        ) -> dict[str, Any]:
  """Train per `cfg` in `workdir`; returns a summary (see `format_summary`).

  The signal handlers are installed first, so a signal during start-up stops it (`Interrupted`);
  the log goes to WORKDIR/train.log once the first step is certain (`launch/run_log.py`)."""
  stop = _Stop()
  run_log = RunLog()
  try:
    summary = _run(cfg, workdir, stop, profile_steps, run_log)
    run_log.write(format_summary(summary, workdir))
    return summary
  except Exception as e:
    run_log.write(f"error: {e}")
    raise
  finally:
    run_log.close()
    stop.restore()


class _Profiler:
  """A jax.profiler trace of steps first..last (1-based, inclusive) into WORKDIR/profile; on a
  resumed run, of the part of that range still to run."""

  def __init__(self, steps: tuple[int, int] | None, workdir: str):
    self.steps, self.directory, self.on = steps, os.path.join(workdir, "profile"), False

  def before(self, step: int) -> None:
    if self.steps and not self.on and self.steps[0] <= step <= self.steps[1]:
      jax.profiler.start_trace(self.directory)
      self.on, self.first = True, step

  def after(self, step: int, outputs) -> None:
    if self.on and step >= self.steps[1]:
      jax.block_until_ready(outputs)
      self.close()
      log.info("profile of steps %d-%d written to %s", self.first, step, self.directory)

  def close(self) -> None:
    if self.on:
      jax.profiler.stop_trace()
      self.on = False


def _run(cfg: ml_collections.ConfigDict, workdir: str, stop: _Stop, profile_text: str | None,
         run_log: RunLog) -> dict[str, Any]:
  t_start = time.time()
  run = setup.run_config(cfg)
  tcfg = run.train
  profile = parse_profile_steps(profile_text, tcfg.steps)
  check_workdir(workdir)
  cache_dir = compile_cache.enable(tcfg.compilation_cache_dir)
  mesh = setup.build_mesh(run.mesh)
  rows = setup.global_batch(run, mesh)
  log.info("mesh %s over %d devices, %d process(es); global batch %d rows",
           dict(mesh.shape), mesh.size, jax.process_count(), rows)
  if (jax.default_backend() == "cpu" and mesh.size > 1 and run.model.scan_layers
      and not xla_flags.cpu_schedule_is_depth_first()):
    log.warning("on a CPU mesh with XLA's breadth-first CPU schedule, a step may stop with "
                "'Termination timeout for ...' (collectives inside the scanned layers' "
                "conditionals run in different orders on different devices); "
                "--xla_cpu_enable_concurrency_optimized_scheduler=false in XLA_FLAGS (the default "
                "unless DSV41_XLA_DEFAULTS=0) or --config.model.scan_layers=false avoids it "
                "(user guide §8)")
  for warning in schedule.notes(run.optim, tcfg.steps):
    log.warning("schedule: %s", warning)
  primary = jax.process_index() == 0
  stored = ckpt_lib.check_config(workdir, cfg.to_dict())

  # --- data ---
  try:
    tok = make_tokenizer(run.data, run.model.vocab_size)
  except (KeyError, ValueError, OSError) as e:  # the message names data.tokenizer_path
    raise SetupError(_data_error(e)) from None
  cmap = setup.compression_map(run.model, tok)
  features = setup.EngramFeatures(run.model, cmap) if cmap is not None else None
  try:
    # One batch of look-ahead: the host builds the next batch while the device runs the step.
    train_it = Lookahead(make_train_iterator(run.data, jax.process_index(), jax.process_count(),
                                             tokenizer=tok, token_features=features))
  except (KeyError, ValueError, OSError) as e:  # the messages name the data key or path
    raise SetupError(_data_error(e)) from None
  t_data = time.time()
  ctx = _Context(cfg, run, workdir, mesh, tok, features,
                 setup.BatchAdapter(run.model, run.data, mesh, cmap), profile, primary,
                 t_start, t_data, cache_dir, stored, run_log)
  with contextlib.ExitStack() as cleanup:
    cleanup.callback(train_it.close)
    return _train(ctx, train_it, stop, cleanup)


@dataclasses.dataclass(frozen=True)
class _Context:
  """What `_run` prepared for the loop: the config (raw and typed), where and on what it runs,
  the tokenizer with its data features and batch adapter, and the start-up times."""

  cfg: ml_collections.ConfigDict
  run: setup.RunConfig
  workdir: str
  mesh: jax.sharding.Mesh
  tokenizer: Any
  features: setup.EngramFeatures | None
  adapter: setup.BatchAdapter
  profile: tuple[int, int] | None   # steps to trace (parse_profile_steps)
  primary: bool                     # process 0: writes the logs
  t_start: float                    # time.time() at the start of `_run`
  t_data: float                     # ... once the data pipeline was open
  cache_dir: str | None             # the persistent compilation cache, if on
  stored: dict | None               # the work directory's config.json, if any
  log: RunLog                       # train.log, opened by `_commit`


def _schedule_change(ctx: _Context, start: int) -> str | None:
  """The resume's schedule warning (`schedule.changed`), against the config the work directory
  stores; None without one or when the schedule is the same."""
  if not ctx.stored or "optim" not in ctx.stored:
    return None
  data = ctx.stored.get("data", {})
  tokens = (data.get("batch_size", ctx.run.data.batch_size) * jax.process_count()
            * data.get("seq_len", ctx.run.data.seq_len))
  try:
    old = optim_config({**ctx.stored["optim"], "tokens_per_step": tokens})
    return schedule.changed(old, ctx.run.optim, start)
  except (KeyError, TypeError, ValueError):  # a config.json of another version: nothing to compare
    return None


def _commit(ctx: _Context, start: int) -> None:
  """The first step is certain to start: write what a run keeps in its work directory (its
  config, the checkpoint directory, train.log with what was logged so far)."""
  if ctx.primary:
    ckpt_lib.write_config(ctx.workdir, ctx.cfg.to_dict())
  os.makedirs(ctx.workdir, exist_ok=True)
  ctx.log.open_file(ctx.workdir)


def _phases(train_vit_at, start: int, steps: int) -> list[bool]:
  """The `train_vit` phases of steps [start, steps), the first one's first."""
  return list(dict.fromkeys([train_vit_at(start), train_vit_at(steps - 1)]))


def _log_compiling(run: setup.RunConfig, phases) -> None:
  log.info("compiling the train step (%s)", " and ".join(
      "ViT trainable" if tv else "ViT frozen" for tv in phases)
      if run.model.vision is not None else "text only")


def _train(ctx: _Context, train_it, stop: _Stop, cleanup: contextlib.ExitStack
           ) -> dict[str, Any]:
  run, tcfg, adapter, mesh = ctx.run, ctx.run.train, ctx.adapter, ctx.mesh
  checkpointer = ckpt_lib.Checkpointer(ctx.workdir, tcfg.keep_checkpoints)
  cleanup.callback(checkpointer.close)

  def train_vit_at(step: int) -> bool:
    """The ViT trains only once unfrozen (optim.frozen / unfreeze_at): one program per phase."""
    return not run.optim.frozen or frozen_trainable(run.optim, step)

  # --- the train step compiles from abstract arguments on worker threads while the state is
  # created: the phases of the newest checkpoint's step onwards (a fall-back restore to an older
  # step, or arguments that differ from the abstract ones, compile again below) ---
  t_compile = time.perf_counter()
  newest = (checkpointer.steps() or [0])[-1]
  ahead = None
  device_bytes = setup.device_memory(mesh) if tcfg.memory_check else None
  if newest < tcfg.steps:
    global_rows = setup.global_batch(run, mesh)
    # a step the memory plan puts over the device's memory: one line now, no compile
    short = setup.plan_shortfall(run, mesh, global_rows, device_bytes)
    if short:
      raise SetupError(short)
    phases = _phases(train_vit_at, newest, tcfg.steps)
    _log_compiling(run, phases)
    ats, args, sched = setup.ahead_args(run, mesh, adapter, global_rows)
    ahead = setup.start_train_steps(setup.train_step_jit(run, ats), mesh, phases, args, sched,
                                    in_order=True)
  t_ahead = time.perf_counter() - t_compile   # the abstract state, on this thread
  # --- model and optimizer, created directly with their shardings, or restored ---
  ts = setup.init_state(run, mesh)
  start = 0
  with ctx.log.quiet():  # a damaged checkpoint's tracebacks: train.log only
    restored = checkpointer.restore_latest(ckpt_lib.abstract_like(ts.checkpoint(0)), train_it)
  if restored is not None:
    start, tree = restored
    ts.restored(tree)
    log.info("resumed from step %d of %s", start, checkpointer.directory)
    change = _schedule_change(ctx, start) if start < tcfg.steps else None
    if change:
      log.warning("schedule: %s", change)
  elif (imported := checkpointer.restore_imported(ckpt_lib.abstract_like(ts.state.params),
                                                  ckpt_lib.abstract_like(ts.state.moe_bias))):
    ts.state = ts.state._replace(params=imported[0], moe_bias=imported[1])
    log.info("starting at step 0 from the weights launch.convert imported from %s; the "
             "optimizer state is fresh", checkpointer.imported["source"])
  t_state = time.time()
  parts = ", ".join(f"{k} {v:.1f}" for k, v in ts.seconds.items())
  log.info("startup: config and data %.1f s, model and optimizer state %.1f s (%s, checkpoint "
           "lookup %.1f, abstract state for the compilation %.1f)", ctx.t_data - ctx.t_start,
           t_state - ctx.t_data, parts, t_state - ctx.t_data - sum(ts.seconds.values()) - t_ahead,
           t_ahead)
  if start >= tcfg.steps:  # nothing to train: the work directory stays as it is
    return {"start_step": start, "end_step": start, "steps": tcfg.steps, "losses": {}, "eval": {},
            "seconds": time.time() - ctx.t_start, "compile_seconds": 0.0,
            "tokens_per_step": run.tokens_per_step, "interrupted": None,
            "params": ts.state.params, "moe_bias": ts.state.moe_bias,
            "median_tokens_per_second": None, "mfu": None, "data": {}}

  rows = next(train_it)
  log.info("process %d: first batch at step %d: %d rows, tokens sha256 %s",
           jax.process_index(), start + 1, len(rows["tokens"]), batch_digest(rows))
  batch = adapter(rows)
  phases = _phases(train_vit_at, start, tcfg.steps)
  lr_schedule = setup.schedule_input(run, ts)  # data: a new train.steps compiles nothing new
  why = None if ahead is None else setup.signature_mismatch(ahead.args,
                                                            (ts.state, batch, lr_schedule))
  if why is not None:
    log.warning("the train step compiled ahead does not take this run's arguments (%s): "
                "compiling it again for them", why)
  sources = [ahead] if ahead is not None and why is None else []
  missing = [tv for tv in phases if not any(c.holds(tv) for c in sources)]
  if missing:  # no ahead compilation (nothing was to train), another phase, or other arguments
    if not sources:
      t_compile = time.perf_counter()
    _log_compiling(run, missing)
    sources.append(setup.start_train_steps(setup.train_step_jit(run, ts), mesh, missing,
                                           (ts.state, batch), lr_schedule, in_order=True))
  # The phases' programs compile one after another: the first phase's is awaited here, a later
  # phase's (the ViT unfrozen) goes on compiling on its thread while the first phase trains.
  train_steps: dict[bool, Any] = {}
  param_bytes = sum(x.addressable_shards[0].data.nbytes
                    for x in jax.tree.leaves(ts.state.params)) if device_bytes else 0.0

  def program(tv: bool):
    """The train step of phase `tv`, awaited (and checked against the device's memory) once."""
    if tv not in train_steps:
      t = time.perf_counter()
      train_steps.update(next(c for c in sources if c.holds(tv)).wait(poll=stop.check,
                                                                      only=(tv,)))
      if tv != phases[0] and time.perf_counter() - t > 1.0:
        log.info("waited %.1f s for the %s train step, compiling since the start",
                 time.perf_counter() - t, "ViT-trainable" if tv else "ViT-frozen")
      # a program over the device's memory: one line now, not an out-of-memory error later
      short = setup.memory_shortfall(train_steps[tv], run, mesh, setup.global_batch(run, mesh),
                                     param_bytes, device_bytes)
      if short:
        raise SetupError(short)
    return train_steps[tv]

  program(phases[0])
  compile_s = time.perf_counter() - t_compile
  log.info("train step compiled in %.1f s (%scompilation cache: %s)%s", compile_s,
           "begun beside the model and optimizer state; " if ahead and not why else "",
           ctx.cache_dir or "off",
           "; the ViT-trainable program compiles on while the first phase trains"
           if len(phases) > 1 else "")
  eval_step = setup.eval_step(run, ts, mesh)
  token_bytes = replicate(evaluation.token_byte_lengths(ctx.tokenizer, run.model.vocab_size),
                          ts.replicated)

  def evaluate() -> dict[str, float]:
    return evaluation.evaluate(
        lambda b: eval_step(ts.state.params, ts.state.moe_bias, adapter(b), token_bytes),
        make_eval_iterator(run.data, jax.process_index(), jax.process_count(),
                           tokenizer=ctx.tokenizer, token_features=ctx.features),
        tcfg.eval_batches)

  stop.check()
  _commit(ctx, start)
  progress = Progress(run, ctx.workdir, start, ctx.primary, ctx.cfg.to_dict(), train_it)
  cleanup.callback(progress.close)
  if progress.bar is not None:  # log lines go above the bar, not into it; step lines: file only
    from tqdm.contrib.logging import logging_redirect_tqdm
    cleanup.enter_context(logging_redirect_tqdm([logging.getLogger("dsv41")]))
    for h in logging.getLogger("dsv41").handlers:
      if type(h).__name__ == "_TqdmLoggingHandler":
        h.addFilter(lambda r: not r.name.startswith(STEP_LOG))
  profiler = _Profiler(ctx.profile, ctx.workdir)
  cleanup.callback(profiler.close)
  last_eval: dict[str, float] = {}
  bad_in_a_row, step = 0, start
  saved = start if restored is not None else None
  stop.in_loop = True
  while step < tcfg.steps:
    t0 = time.perf_counter()
    if batch is None:
      batch = adapter(next(train_it))   # the batch peeked during the last step, or a new one
    t1 = time.perf_counter()
    profiler.before(step + 1)
    # The next batch is built on a background thread while this step is dispatched and run: the
    # dispatch may itself wait for the device (data/lookahead.py). A checkpoint of this step still
    # records the data position before the peek.
    if step + 1 < tcfg.steps:
      train_it.start_peek()
    ts.state, m = program(train_vit_at(step))(ts.state, batch, lr_schedule)
    t2 = time.perf_counter()
    batch, step = None, step + 1
    host = 0.0
    if step < tcfg.steps:
      train_it.peek()                    # joins the background peek
      host = train_it.host_seconds
    t3 = time.perf_counter()
    finite = bool(m["finite"])           # waits for the device
    t4 = time.perf_counter()
    profiler.after(step, m)
    # Data wait: the fetch at the top, plus the join when the device was already done by its end
    # (then the peek may have held the device idle; an upper bound). `data_host`: the peek's own
    # time; `dispatch`: how long the step's call took to return.
    exposed = max(0.0, t3 - t2) if t4 - t3 < _DEVICE_DONE_S else 0.0
    progress.step(step, m, time.perf_counter() - t0, (t1 - t0) + exposed, data_host=host,
                  dispatch=t2 - t1)
    bad_in_a_row = 0 if finite else bad_in_a_row + 1
    if not finite:
      log.warning("step %d: non-finite loss %s, gradient norm %s or update norm %s; update "
                  "skipped", step, float(m["loss"]), float(m["grad_norm"]),
                  float(m["update_norm"]))
    if bad_in_a_row >= tcfg.max_bad_steps:  # after the step's metrics are logged
      raise TrainingError(
          f"{bad_in_a_row} consecutive steps had a non-finite loss or gradient (last at step "
          f"{step}); stopping. The last good checkpoint is intact in {checkpointer.directory}"
          f" (steps {checkpointer.steps()}); lower optim.lr or check the data.")
    if tcfg.eval_every and (step % tcfg.eval_every == 0 or step == tcfg.steps):
      last_eval = evaluate()
      progress.eval(step, last_eval)
    stopping = stop.agreed()
    if finite and (step % tcfg.checkpoint_every == 0 or step == tcfg.steps or stopping):
      checkpointer.save(step, ts.checkpoint(step), train_it)
      saved = step
    if stopping:
      if saved == step:
        log.warning("%s: saved step %d, exiting", stop.requested or "signal", step)
      else:
        log.warning("%s: step %d was not finite and is not saved (last checkpoint: %s); "
                    "exiting", stop.requested or "signal", step, saved)
      break
  cleanup.close()  # finish the last save (a failure raises here), close the writers
  return {"start_step": start, "end_step": step, "steps": tcfg.steps, "losses": progress.losses,
          "eval": last_eval, "seconds": time.time() - ctx.t_start,
          "compile_seconds": compile_s, "tokens_per_step": run.tokens_per_step,
          "interrupted": stop.requested, "params": ts.state.params,
          "moe_bias": ts.state.moe_bias, "data": train_it.counters(),
          **progress.figures()}


def _exit(code: int) -> None:
  """Exit with `code`; at once (`os._exit`, streams flushed) while a train-step compilation
  still runs on a worker thread (the one started beside the state's creation), which the
  interpreter would otherwise wait for."""
  if any(t.is_alive() and not t.daemon for t in threading.enumerate()
         if t is not threading.main_thread()):
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
  sys.exit(code)


def main(argv):
  del argv
  cli.log_to_stderr()
  xla_flags.apply_defaults()   # before the first jax call starts the backend
  init_distributed(_COORD.value, _NPROC.value, _PID.value)
  try:
    summary = run(_CONFIG.value, _WORKDIR.value, _PROFILE.value)
  except (TrainingError, SetupError, ckpt_lib.WorkdirMismatch, ckpt_lib.RestoreError,
          ckpt_lib.SaveError, metrics_lib.MetricsError) as e:
    print(f"error: {e}", file=sys.stderr)
    _exit(2)
  except Interrupted as e:
    print(f"{e}: stopped during start-up; nothing was trained or saved, the work directory is "
          "as it was", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)  # compilation threads may still run: do not wait for them
  print(format_summary(summary, _WORKDIR.value), flush=True)
  _exit(0)  # a later phase's compilation may still run when a signal ended the first phase


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=parse_flags)
