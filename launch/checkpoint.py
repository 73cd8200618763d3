"""Checkpoints with orbax (docs/design.md §T4): train state, data-iterator state and resolved config.

Layout of a work directory:

    DIR/checkpoints/<step>/state       parameters, optimizer state, MoE biases, step (orbax)
    DIR/checkpoints/<step>/data_iter   the grain iterator state (per process)
    DIR/config.json                    the resolved config of the run that owns DIR
    DIR/imported.json                  written by `launch.convert import`: its step holds only
                                       parameters and MoE biases (docs/checkpoints.md)

Saves are asynchronous; `CheckpointManager` keeps the newest `keep` steps and only lists a step
once it is complete, so a save that fails or is killed never replaces the last good checkpoint.
A newest checkpoint that cannot be restored (damaged files) is skipped with a warning in favour
of the one before, and moved aside to `damaged-<step>`; when checkpoints exist but none restores,
`RestoreError` stops the run instead of silently starting over. Restoring takes abstract leaves
that carry the *current* mesh's shardings, so a run can resume on a different mesh shape.

A save that fails (a full disk, a lost mount: reported by `save`, `wait` or `close`, since saves
finish in the background) raises `SaveError` after removing the step's temporary
`*.orbax-checkpoint-tmp*` directory; the checkpoints saved before are untouched.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from launch.run_log import DETAIL

log = logging.getLogger("dsv41.checkpoint")
detail = logging.getLogger(DETAIL)  # tracebacks: train.log only (launch/run_log.py)

MODEL_SECTION = "model"
IMPORTED = "imported.json"


class WorkdirMismatch(ValueError):
  """The work directory holds a checkpoint of another model."""


class RestoreError(RuntimeError):
  """Checkpoints exist but none can be restored (damaged, or saved by an incompatible run)."""


class SaveError(RuntimeError):
  """A checkpoint could not be written; the message names the step, the cause and the fix."""


def _jsonable(tree: Any) -> Any:
  if isinstance(tree, dict):
    return {k: _jsonable(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_jsonable(v) for v in tree]
  return tree


def check_config(workdir: str, config: dict) -> dict | None:
  """Refuse a work directory whose checkpoints belong to another model (its stored model section
  differs); returns the stored config (None without one). Reads only."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    stored = json.load(f)
  ckpts = os.path.join(workdir, "checkpoints")
  if os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)):
    config = _jsonable(config)
    old, new = stored.get(MODEL_SECTION, {}), config.get(MODEL_SECTION, {})
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
      detail = ", ".join(f"{k}: stored {old.get(k)!r} vs now {new.get(k)!r}" for k in diff[:8])
      raise WorkdirMismatch(
          f"{workdir} holds checkpoints of another model (config.model differs in {diff}: "
          f"{detail}); use a new --workdir or the stored model settings")
  return stored


def write_config(workdir: str, config: dict) -> None:
  """Store the run's resolved config as DIR/config.json (atomically)."""
  path = os.path.join(workdir, "config.json")
  os.makedirs(workdir, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(_jsonable(config), f, indent=1, sort_keys=True)
  os.replace(tmp, path)


class Checkpointer:
  """Asynchronous saves and fall-back restores of one work directory's checkpoints."""

  def __init__(self, workdir: str, keep: int):
    """Opens the checkpoints of `workdir` without creating anything: the directory is made by
    the first `save`."""
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=False,
                                             enable_async_checkpointing=True),
        item_names=("state", "data_iter"))
    self._pending: int | None = None  # the step whose background save may still be running
    path = os.path.join(os.path.abspath(workdir), IMPORTED)
    self.imported: dict | None = None   # launch.convert's record of an imported step
    if os.path.exists(path):
      with open(path) as f:
        self.imported = json.load(f)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: dict, data_iter: grain.DatasetIterator) -> None:
    """Start saving `step` (the previous save is finished first); SaveError if either fails."""
    try:
      os.makedirs(self.directory, exist_ok=True)
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data_iter=grain.checkpoint.CheckpointSave(data_iter)))
    except Exception as e:  # noqa: BLE001 -- any failure to write is reported the same way
      self._failed(step, e)
    self._pending = step

  def _failed(self, step: int | None, error: Exception) -> None:
    """Remove the failed save's temporary directories, then raise SaveError."""
    if jax.process_index() == 0:
      for tmp in glob.glob(os.path.join(self.directory, "*.orbax-checkpoint-tmp*")):
        shutil.rmtree(tmp, ignore_errors=True)
    try:
      self.manager.reload()
      kept = self.steps()
    except Exception:  # noqa: BLE001 -- the listing is for the message only
      kept = []
    first_line = (str(error).splitlines() or [""])[0][:300]
    last = f"step {kept[-1]}" if kept else "none yet"
    raise SaveError(
        f"saving the checkpoint of step {step} in {self.directory} failed "
        f"({type(error).__name__}: {first_line}); its temporary files are removed and the last "
        f"good checkpoint ({last}) is intact. Free disk space (or choose another --workdir with "
        f"a copy of it) and run again to resume") from None

  def restore_latest(self, abstract_state: dict, data_iter: grain.DatasetIterator
                     ) -> tuple[int, dict] | None:
    """Restore the newest readable checkpoint into `data_iter`; None when there is none.

    Damaged checkpoints newer than the one restored are moved aside to `damaged-<step>` (the run
    will save those steps again, and orbax refuses to overwrite a step). When checkpoints exist
    but none restores, nothing is moved and `RestoreError` says so: starting over silently would
    hide an incompatible configuration (another optimizer state layout, say)."""
    damaged, errors = {}, []
    result = None
    for step in reversed(self.steps()):
      if self.imported is not None and step == self.imported["step"]:
        continue  # weights only: `restore_imported`
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data_iter=grain.checkpoint.CheckpointRestore(data_iter)))
        result = step, restored["state"]
        break
      except Exception as e:  # a damaged checkpoint: fall back to the one before
        first_line = (str(e).splitlines() or [""])[0][:160]
        detail.warning("checkpoint at step %d cannot be restored", step, exc_info=True)
        damaged[step] = f"{type(e).__name__}: {first_line}"
        errors.append(f"step {step}: {damaged[step]}")
    if damaged and result is None:
      raise RestoreError(
          f"none of the checkpoints in {self.directory} can be restored ({'; '.join(errors)}); "
          "if they are damaged, move them away; if the optimizer or model settings changed, "
          "restore those settings or use a new --workdir")
    for step, target in self._move_aside(sorted(damaged)).items():
      log.warning("checkpoint at step %d cannot be restored (%s); moved to %s, resuming from step "
                  "%d (the detail is in train.log)", step, damaged[step], target, result[0])
    return result

  def restore_imported(self, abstract_params: Any, abstract_moe_bias: Any) -> tuple | None:
    """(params, moe_bias) of the step `launch.convert import` wrote, if it is still there."""
    if self.imported is None or self.imported["step"] not in self.steps():
      return None
    restored = self.manager.restore(self.imported["step"], args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"params": abstract_params, "moe_bias": abstract_moe_bias})))
    return restored["state"]["params"], restored["state"]["moe_bias"]

  def _move_aside(self, steps: list[int]) -> dict[int, str]:
    """Rename each damaged step's directory to `damaged-<step>`; step -> where it went."""
    moved = {}
    if steps and jax.process_index() == 0:
      for step in steps:
        target = os.path.join(self.directory, f"damaged-{step}")
        n = 0
        while os.path.exists(target):
          n += 1
          target = os.path.join(self.directory, f"damaged-{step}.{n}")
        os.rename(os.path.join(self.directory, str(step)), target)
        moved[step] = target
    if steps and jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("dsv41: damaged checkpoints moved aside")
    if steps:
      self.manager.reload()
    return moved

  def wait(self) -> None:
    """Block until the background save is complete; SaveError if it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      self._failed(self._pending, e)
    self._pending = None

  def close(self) -> None:
    """Finish the background save (SaveError if it failed) and release the manager."""
    try:
      self.wait()
    finally:
      self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs carrying the leaves' current shardings (a restore target)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
