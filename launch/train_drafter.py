"""The DSpark drafter stage: train a drafter on a frozen pre-trained backbone (docs/design.md §16.2).

  python -m launch.train_drafter --config=configs/dspark.py --backbone=/tmp/dsv41_tiny \
      --workdir=/tmp/dsv41_tiny_drafter [--config.train.steps=300]

The backbone is restored from its work directory (`launch.generate.load_model`: parameters and MoE
biases of its newest checkpoint, or `--backbone_step`) and never updated: the step differentiates
the drafter's parameters only, reading the backbone's logits and final hidden states through
`stop_gradient`. The data is the backbone's own training stream (its config.json's data section,
`train.batch_size` rows a step), on one device (docs/design.md §16.6). The drafter work directory
holds `config.json` (the resolved drafter config and the backbone it was trained on),
`metrics.jsonl` and orbax checkpoints of the drafter's parameters, optimizer state and
data-iterator state (`launch/checkpoint.py`); a work directory with a checkpoint is resumed from
it, bit for bit like `launch.train`.

Bad input stops with one `error: …` line, exit 2: a drafter config whose `hidden_size` or
`vocab_size` differs from the backbone's, a drafter work directory trained on another backbone,
a backbone directory without a checkpoint.

The directory's format, its errors and `load_drafter` are in `launch/drafter.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from dsv41_jax.dspark.loss import draft_targets, drafter_losses
from dsv41_jax.dspark.model import Drafter
from dsv41_jax.inference.decode import head_logits
from launch import checkpoint as ckpt_lib, cli, metrics as metrics_lib, setup
from launch.drafter import DrafterStageError, drafter_config
from launch.generate import LoadedModel, LoadError, load_model
from launch.step import model_inputs

log = logging.getLogger("dsv41.train_drafter")


def _backbone_record(loaded: LoadedModel, backbone_dir: str) -> dict:
  m = loaded.model.cfg
  return {"workdir": os.path.abspath(backbone_dir), "step": int(loaded.step),
          "hidden_size": m.hidden_size, "vocab_size": m.vocab_size}


def _check_or_write(workdir: str, record: dict) -> None:
  """Refuse a drafter work directory trained with another drafter config or on another backbone."""
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    with open(path) as f:
      stored = json.load(f)
    for section in ("backbone", "drafter"):
      old, new = stored.get(section, {}), record[section]
      diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
      if diff:
        detail = ", ".join(f"{k}: stored {old.get(k)!r} vs now {new.get(k)!r}" for k in diff[:6])
        raise DrafterStageError(f"{workdir} holds a drafter of another {section} ({detail}); use "
                                "a new --workdir")
  os.makedirs(workdir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)


def backbone_config(loaded: LoadedModel, batch_size: int) -> ml_collections.ConfigDict:
  """The backbone run's config with `batch_size` rows a step; data keys added since that run was
  written take their defaults."""
  from data.config import data_defaults
  d = loaded.config.to_dict()
  d["data"] = {**data_defaults(), **d["data"], "batch_size": batch_size}
  return ml_collections.ConfigDict(d)


@functools.lru_cache(maxsize=8)
def _make_step(graphdef, dgraph, tcfg: tuple):
  """The jitted drafter step: (drafter params, opt state, backbone params, MoE bias, batch) →
  (drafter params, opt state, figures); gradients only for the drafter."""
  steps, lr, warmup, wd, conf_w = tcfg
  tx = _optimizer(steps, lr, warmup, wd)

  def loss_fn(dp, h, logits, batch, embed, head):
    d = nnx.merge(dgraph, dp)
    z, base = d(h, batch["tokens"], batch["positions"], batch["segment_ids"], embed, head)
    prev, valid = draft_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"],
                                d.dc.draft_len)
    draft_logits = base + d.markov(prev)
    return drafter_losses(draft_logits, d.confidence_logit(z, draft_logits), logits, valid, conf_w)

  def step(dp, opt_state, params, moe_bias, batch):
    backbone = nnx.merge(graphdef, params)
    (h, _), _ = backbone(model_inputs(batch), moe_bias, return_hidden=True)
    h = jax.lax.stop_gradient(h)
    logits = jax.lax.stop_gradient(head_logits(backbone, h))
    (loss, figs), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        dp, h, logits, batch, backbone.embed[...], backbone.head[...])
    updates, opt_state = tx.update(grads, opt_state, dp)
    return optax.apply_updates(dp, updates), opt_state, dict(figs, loss=loss,
                                                              grad_norm=optax.tree.norm(grads))

  return jax.jit(step, donate_argnums=(0, 1))


def _optimizer(steps: int, lr: float, warmup: int, wd: float) -> optax.GradientTransformation:
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps - 1)), steps,
                                             lr * 0.1)
  return optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=wd)


def run(cfg: ml_collections.ConfigDict, backbone_dir: str, workdir: str,
        backbone_step: int | None = None, stop_at: int | None = None) -> dict:
  """Train the drafter per `cfg` on the backbone of `backbone_dir` in `workdir`; returns a summary
  (steps, last figures, the drafter parameters and the backbone parameters it read). `stop_at`
  ends the run after that step with a checkpoint, as an interrupted run would (tests)."""
  from data.pipeline import make_train_iterator
  t0 = time.time()
  try:
    loaded = load_model(backbone_dir, backbone_step)
  except LoadError as e:
    raise DrafterStageError(f"--backbone: {e}") from None
  mcfg = loaded.model.cfg
  dc = drafter_config(cfg.drafter, mcfg)
  t = cfg.train
  record = {"drafter": dataclasses.asdict(dc), "backbone": _backbone_record(loaded, backbone_dir),
            "train": t.to_dict()}
  _check_or_write(workdir, record)

  bcfg = backbone_config(loaded, int(t.batch_size))
  run_cfg = setup.run_config(bcfg)
  features = (setup.EngramFeatures(run_cfg.model, loaded.compression_map)
              if mcfg.engram_layer_ids else None)
  train_it = make_train_iterator(run_cfg.data, jax.process_index(), jax.process_count(),
                                 tokenizer=loaded.tokenizer, token_features=features)
  # One device: the backbone is restored onto the first (`load_model`), the batch stays with it.
  adapter = setup.BatchAdapter(run_cfg.model, run_cfg.data, None, loaded.compression_map)

  graphdef, params = nnx.split(loaded.model)
  dgraph, dstate = nnx.split(Drafter(dc, nnx.Rngs(int(t.seed))))
  dparams = nnx.as_pure(dstate)             # plain arrays: what the checkpoint holds
  tx = _optimizer(int(t.steps), float(t.lr), int(t.warmup_steps), float(t.weight_decay))
  opt_state = tx.init(dparams)
  checkpointer = ckpt_lib.Checkpointer(workdir, int(t.keep_checkpoints))
  state = {"params": dparams, "opt_state": opt_state, "step": jnp.int32(0)}
  restored = checkpointer.restore_latest(ckpt_lib.abstract_like(state), train_it)
  start = 0
  if restored is not None:
    start, tree = restored
    dparams, opt_state = tree["params"], tree["opt_state"]
    log.info("resumed the drafter from step %d of %s", start, checkpointer.directory)
  step_fn = _make_step(graphdef, dgraph, (int(t.steps), float(t.lr), int(t.warmup_steps),
                                          float(t.weight_decay), float(t.confidence_weight)))
  writer = metrics_lib.MetricWriter(workdir, jax.process_index() == 0, "", record)
  figs = {}
  try:
    for step in range(start + 1, int(t.steps) + 1):
      batch = adapter.host(next(train_it))
      dparams, opt_state, figs = step_fn(dparams, opt_state, params, loaded.moe_bias, batch)
      if step % int(t.log_every) == 0 or step == int(t.steps):
        figs = jax.tree.map(np.asarray, figs)
        writer.write(step, figs)
        log.info("step %d loss %.4f draft %.4f confidence %.4f accepted length %.3f "
                 "(teacher-forced, of %d)", step, figs["loss"], figs["draft_loss"],
                 figs["confidence_loss"], figs["accepted_length"], dc.draft_len)
      if step % int(t.checkpoint_every) == 0 or step in (int(t.steps), stop_at):
        checkpointer.save(step, {"params": dparams, "opt_state": opt_state,
                                 "step": jnp.int32(step)}, train_it)
      if step == stop_at:
        break
  finally:
    checkpointer.close()
    writer.close()
    train_it.close()
  end = start if start >= int(t.steps) else step
  return {"start_step": start, "end_step": end, "figures": figs,
          "drafter_params": dparams, "backbone_params": params, "seconds": time.time() - t0}


def main(argv):
  del argv
  cli.log_to_stderr()
  try:
    s = run(_FLAGS["config"].value, _FLAGS["backbone"].value, _FLAGS["workdir"].value,
            _FLAGS["backbone_step"].value)
  except (DrafterStageError, setup.SetupError, ckpt_lib.RestoreError, ckpt_lib.SaveError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  f = s["figures"]
  last = (f"loss {float(f['loss']):.4f}, teacher-forced accepted length "
          f"{float(f['accepted_length']):.3f}" if f else "nothing to train")
  print(f"done: drafter steps {s['start_step']}→{s['end_step']}, {last}, {s['seconds']:.0f} s",
        flush=True)


_FLAGS = {}


def _define_flags():
  """The program's flags, defined only when run as a program: `launch.train` defines `--config`
  too, and a process that imports both (a test worker) must not see it defined twice."""
  _FLAGS["config"] = config_flags.DEFINE_config_file("config", None, "Drafter config file.",
                                                     lock_config=True)
  _FLAGS["backbone"] = flags.DEFINE_string("backbone", None, "Work directory of a launch.train run.")
  _FLAGS["backbone_step"] = flags.DEFINE_integer("backbone_step", None,
                                                 "Backbone checkpoint (default newest).")
  _FLAGS["workdir"] = flags.DEFINE_string("workdir", None, "The drafter's work directory.")


if __name__ == "__main__":
  _define_flags()
  flags.mark_flags_as_required(["config", "backbone", "workdir"])
  app.run(main, flags_parser=cli.parse_flags)
