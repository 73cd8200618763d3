"""Learning-rate schedule (docs/design.md §T2): linear warm-up, hold, cosine decay, hold.

With step s counted from 0 (the s-th update), W warm-up steps and the decay window [D0, D1):

  lr(s) = peak · (s + 1) / W                                   s < W
        = peak                                                 W ≤ s < D0
        = peak · (f + (1 − f) · ½(1 + cos(π (s − D0) / (D1 − D0))))   D0 ≤ s < D1
        = peak · f                                             s ≥ D1

f = `final_lr_fraction` (0.1). D0 and D1 come from the config as fractions of the run
(`schedule_unit="fraction"`: round(x · total_steps), so the schedule follows `train.steps`), in
steps, or in tokens divided by `tokens_per_step` and rounded up (the first step that starts at or
after the token boundary). `outside_run` names absolute boundaries that a run of a given length
never reaches, for the launcher to warn about.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from optim.config import OptimConfig, OptimConfigError


@dataclasses.dataclass(frozen=True)
class Boundaries:
  warmup: int
  decay_start: int
  decay_end: int


def boundaries(cfg: OptimConfig) -> Boundaries:
  """Schedule boundaries in steps."""
  if cfg.schedule_unit == "fraction" and cfg.total_steps <= 0:
    raise OptimConfigError("schedule_unit='fraction' needs total_steps (the run's length; "
                           "configs/common.py links it to train.steps)")

  def steps(x: float) -> int:
    if cfg.schedule_unit == "fraction":
      return int(round(x * cfg.total_steps))
    if cfg.schedule_unit == "steps":
      return int(round(x))
    return int(math.ceil(x / cfg.tokens_per_step - 1e-9))
  b = Boundaries(cfg.warmup_steps, steps(cfg.decay_start), steps(cfg.decay_end))
  if b.warmup > b.decay_start:
    where = (f" = {cfg.decay_start} × total_steps {cfg.total_steps}"
             if cfg.schedule_unit == "fraction" else "")
    raise OptimConfigError(f"warm-up ({b.warmup} steps) ends after decay_start "
                           f"({b.decay_start} steps{where}); shorten warmup_steps or move "
                           "decay_start")
  return b


def outside_run(cfg: OptimConfig, run_steps: int) -> list[str]:
  """Warnings for schedule boundaries a run of `run_steps` steps never reaches (empty if none).

  A fractional schedule always fits; an absolute one (steps, tokens) set for another run length
  would otherwise end the run at the peak learning rate, silently."""
  b = boundaries(cfg)
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


def lr_factor(cfg: OptimConfig, step) -> jnp.ndarray:
  """lr(step) / peak, as float32 (traceable: `step` may be a jax integer)."""
  b = boundaries(cfg)
  s = jnp.asarray(step, jnp.float32)
  f = cfg.final_lr_fraction
  warm = (s + 1.0) / max(b.warmup, 1)
  # Boundaries enter as Python floats: a token-count boundary can exceed the int32 range.
  d0, d1 = float(b.decay_start), float(b.decay_end)
  span = max(d1 - d0, 1.0)
  frac = jnp.clip((s - d0) / span, 0.0, 1.0)
  cosine = f + (1.0 - f) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
  out = jnp.where(s < b.warmup, warm, jnp.where(s < d0, 1.0, cosine))
  return jnp.where(s >= d1, f, out).astype(jnp.float32)


def learning_rate(cfg: OptimConfig, step) -> jnp.ndarray:
  """The peak-scaled learning rate at `step`."""
  return cfg.lr * lr_factor(cfg, step)
