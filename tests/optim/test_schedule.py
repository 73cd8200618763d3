"""Learning-rate schedule (optim/schedule.py) at every boundary, against the formula by hand."""

import math

import numpy as np
import pytest

from optim import schedule
from optim.chain import learning_rates
from optim.config import OptimConfig, OptimConfigError


def _ref(s, peak, w, d0, d1, f):
  if s < w:
    return peak * (s + 1) / w
  if s < d0:
    return peak
  if s < d1:
    return peak * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * (s - d0) / (d1 - d0))))
  return peak * f


def test_values_at_every_boundary_in_steps():
  cfg = OptimConfig(lr=2.0, warmup_steps=10, decay_start=30, decay_end=70, schedule_unit="steps",
                    final_lr_fraction=0.25)
  steps = [0, 1, 8, 9, 10, 11, 29, 30, 31, 50, 69, 70, 71, 10_000]
  got = [float(schedule.learning_rate(cfg, s)) for s in steps]
  want = [_ref(s, 2.0, 10, 30, 70, 0.25) for s in steps]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[0] == pytest.approx(0.2) and got[4] == pytest.approx(2.0)   # warm-up ends at peak
  assert got[9] == pytest.approx(2.0 * (0.25 + 0.75 * 0.5))             # half-way down the cosine
  assert got[11] == pytest.approx(0.5) and got[13] == pytest.approx(0.5)  # final hold


def test_token_boundaries_round_up_to_steps():
  cfg = OptimConfig(lr=1.0, warmup_steps=5, decay_start=30_500, decay_end=70_000,
                    schedule_unit="tokens", tokens_per_step=1000)
  assert schedule.boundaries(cfg) == schedule.Boundaries(5, 31, 70)
  # the report's defaults: 2000 warm-up steps, 28T / 40T tokens at 100.6M tokens per step
  b = schedule.boundaries(OptimConfig())
  assert (b.warmup, b.decay_start, b.decay_end) == (
      2000, math.ceil(28e12 / 100.6e6), math.ceil(40e12 / 100.6e6))
  lrs = [float(schedule.learning_rate(OptimConfig(), s)) for s in (0, 1999, b.decay_start,
                                                                    b.decay_end, 10 ** 7)]
  np.testing.assert_allclose(lrs, [2.6e-4 / 2000, 2.6e-4, 2.6e-4, 2.6e-5, 2.6e-5], rtol=1e-6)


def test_bad_schedules_rejected():
  with pytest.raises(OptimConfigError, match="decay_start"):
    OptimConfig(decay_start=10, decay_end=5, schedule_unit="steps")
  with pytest.raises(OptimConfigError, match="warm-up"):
    schedule.boundaries(OptimConfig(warmup_steps=50, decay_start=10, decay_end=20,
                                    schedule_unit="steps"))


def test_learning_rates_per_group_for_logging():
  cfg = OptimConfig(lr=1.0, warmup_steps=0, decay_start=10, decay_end=20, schedule_unit="steps",
                    adamw_lr_mult=0.5)
  lrs = learning_rates(cfg, 3)
  want = {"muon": 1.0, "adamw": 0.5, "sinkhorn": 1.0, "engram_table": 5.0}
  assert {k: lrs[k] for k in want} == pytest.approx(want)
