"""Learning-rate schedule (docs/design.md §T2): linear warm-up, hold, cosine decay, hold.

With step s counted from 0 (the s-th update), W warm-up steps and the decay window [D0, D1):

  lr(s) = peak · (s + 1) / W                                   s < W
        = peak                                                 W ≤ s < D0
        = peak · (f + (1 − f) · ½(1 + cos(π (s − D0) / (D1 − D0))))   D0 ≤ s < D1
        = peak · f                                             s ≥ D1

f = `final_lr_fraction` (0.1). D0 and D1 come from the config as fractions of the run
(`schedule_unit="fraction"`: round(x · total_steps), so the schedule follows `train.steps`), in
steps, or in tokens divided by `tokens_per_step` and rounded up (the first step that starts at or
after the token boundary).

A fractional schedule scales with the run; its warm-up, given in steps, is cut to end where the
decay starts when the run is too short to hold it (`Boundaries.scaled_from` records the configured
length, `notes` words it for the launcher). An absolute schedule (steps, tokens) states its own
boundaries: a warm-up past its decay start is an error, and `notes` names the boundaries a run of
a given length never reaches.

The schedule as data (`Schedule`, `schedule_of`): peak rate, boundaries and final fraction as
float32 scalars, the input the compiled train step reads (`optim.chain`: `tx.update(...,
schedule=...)`), so a new `train.steps` or `optim.lr` runs the same compiled program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from optim.config import OptimConfig, OptimConfigError


@dataclasses.dataclass(frozen=True)
class Boundaries:
  warmup: int
  decay_start: int
  decay_end: int
  scaled_from: int | None = None  # the configured warm-up, when a short run cut it to `warmup`


def boundaries(cfg: OptimConfig) -> Boundaries:
  """Schedule boundaries in steps (a fractional schedule's warm-up cut to fit a short run)."""
  if cfg.schedule_unit == "fraction" and cfg.total_steps <= 0:
    raise OptimConfigError("schedule_unit='fraction' needs total_steps (the run's length; "
                           "configs/common.py links it to train.steps)")

  def steps(x: float) -> int:
    if cfg.schedule_unit == "fraction":
      return int(round(x * cfg.total_steps))
    if cfg.schedule_unit == "steps":
      return int(round(x))
    return int(math.ceil(x / cfg.tokens_per_step - 1e-9))
  d0, d1 = steps(cfg.decay_start), steps(cfg.decay_end)
  if cfg.warmup_steps <= d0:
    return Boundaries(cfg.warmup_steps, d0, d1)
  if cfg.schedule_unit == "fraction":  # the run is shorter than the warm-up assumes
    return Boundaries(d0, d0, d1, scaled_from=cfg.warmup_steps)
  raise OptimConfigError(f"warm-up ({cfg.warmup_steps} steps) ends after decay_start ({d0} steps); "
                         "shorten warmup_steps or move decay_start")


def notes(cfg: OptimConfig, run_steps: int) -> list[str]:
  """One-line warnings about the schedule of a run of `run_steps` steps (empty if none): a
  warm-up scaled to fit a short run, or absolute boundaries the run never reaches (which would
  otherwise end the run at the peak learning rate, silently)."""
  b = boundaries(cfg)
  if b.scaled_from is not None:
    return [f"the run is too short for optim.warmup_steps = {b.scaled_from}: the warm-up is scaled "
            f"to {b.warmup} steps, ending where the decay starts (optim.decay_start = "
            f"{cfg.decay_start:g} × train.steps {cfg.total_steps} = step {b.decay_start}); set "
            "--config.optim.warmup_steps to choose another"]
  unit = "" if cfg.schedule_unit == "steps" else f" ({cfg.schedule_unit})"
  fix = "set optim.schedule_unit='fraction' with decay_start / decay_end as fractions of the run"
  if b.decay_start >= run_steps:
    return [f"the learning rate never decays: optim.decay_start = {cfg.decay_start}{unit} is step "
            f"{b.decay_start}, at or past train.steps = {run_steps}; the run ends at the peak "
            f"rate; {fix}"]
  if b.decay_end > run_steps:
    end = float(lr_factor(cfg, run_steps - 1))
    return [f"the decay is cut short: optim.decay_end = {cfg.decay_end}{unit} is step "
            f"{b.decay_end}, past train.steps = {run_steps}; the run ends at {end:.3f} × the peak "
            f"rate (not {cfg.final_lr_fraction}); {fix}"]
  return []


class Schedule(NamedTuple):
  """The schedule as the train step's input: float32 scalars (numpy on the host, traced inside
  jit), boundaries in steps. Step counts far past 2^24 lose float32 precision (a token boundary
  of a tiny batch); the rate then moves at most one step early or late."""

  lr: np.ndarray
  warmup: np.ndarray
  decay_start: np.ndarray
  decay_end: np.ndarray
  final_fraction: np.ndarray


def schedule_of(cfg: OptimConfig) -> Schedule:
  """The config's schedule as data (`boundaries`, peak `lr`, `final_lr_fraction`)."""
  b = boundaries(cfg)
  return Schedule(*(np.float32(v) for v in (cfg.lr, b.warmup, b.decay_start, b.decay_end,
                                            cfg.final_lr_fraction)))


def lr_factor(schedule: Schedule | OptimConfig, step) -> jnp.ndarray:
  """lr(step) / peak, as float32; `schedule` is a `Schedule` (host values or traced) or the
  config it comes from, `step` a Python or jax integer."""
  sc = schedule_of(schedule) if isinstance(schedule, OptimConfig) else schedule
  s = jnp.asarray(step, jnp.float32)
  f, w, d0, d1 = (jnp.asarray(x, jnp.float32)
                  for x in (sc.final_fraction, sc.warmup, sc.decay_start, sc.decay_end))
  warm = (s + 1.0) / jnp.maximum(w, 1.0)
  frac = jnp.clip((s - d0) / jnp.maximum(d1 - d0, 1.0), 0.0, 1.0)
  cosine = f + (1.0 - f) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
  out = jnp.where(s < w, warm, jnp.where(s < d0, 1.0, cosine))
  return jnp.where(s >= d1, f, out).astype(jnp.float32)


def learning_rate(schedule: Schedule | OptimConfig, step) -> jnp.ndarray:
  """The peak-scaled learning rate at `step` (`schedule` as in `lr_factor`)."""
  sc = schedule_of(schedule) if isinstance(schedule, OptimConfig) else schedule
  return jnp.asarray(sc.lr, jnp.float32) * lr_factor(sc, step)


def changed(old: OptimConfig, new: OptimConfig, step: int) -> str | None:
  """A one-line warning when a run resumed at `step` (updates done) under `new` would follow
  another schedule than the `old` one it ran under, giving the next update's rate under each;
  None when the schedules are equal. Raising `train.steps` moves a fractional schedule's decay
  later, so the rate of the next step can jump back up (issue 33: a 50-step run resumed at 60
  steps ran step 51 at 3.8× the rate it ended at)."""
  a, b = boundaries(old), boundaries(new)
  was, now = schedule_of(old), schedule_of(new)
  if was == now:
    return None
  parts = []
  if old.total_steps != new.total_steps:
    parts.append(f"train.steps {old.total_steps} → {new.total_steps}")
  if a.warmup != b.warmup:
    parts.append(f"warm-up {a.warmup} → {b.warmup} steps")
  if (a.decay_start, a.decay_end) != (b.decay_start, b.decay_end):
    parts.append(f"decay over steps {a.decay_start}-{a.decay_end} → "
                 f"{b.decay_start}-{b.decay_end}")
  if was.lr != now.lr:
    parts.append(f"peak lr {float(was.lr):g} → {float(now.lr):g}")
  if was.final_fraction != now.final_fraction:
    parts.append(f"final fraction {float(was.final_fraction):g} → {float(now.final_fraction):g}")
  lr_was, lr_now = float(learning_rate(was, step)), float(learning_rate(now, step))
  ratio = f" (×{lr_now / lr_was:.2f})" if lr_was > 0 else ""
  return (f"resuming at step {step} under another schedule than the run's ({'; '.join(parts)}): "
          f"step {step + 1} runs at lr {lr_now:.3g}, where the run's schedule gives {lr_was:.3g}"
          f"{ratio}; to continue the run's schedule, resume with its settings (or set "
          "optim.schedule_unit='steps' with decay_start / decay_end in steps)")
