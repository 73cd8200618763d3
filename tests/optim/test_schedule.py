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


def test_fraction_boundaries_follow_the_run_length():
  """schedule_unit="fraction": D0 = round(0.6·N), D1 = N, for several run lengths N."""
  for n in (50, 300, 1001):
    cfg = OptimConfig(lr=1.0, warmup_steps=5, decay_start=0.6, decay_end=1.0,
                      schedule_unit="fraction", total_steps=n, final_lr_fraction=0.1)
    assert schedule.boundaries(cfg) == schedule.Boundaries(5, round(0.6 * n), n)
    steps = [0, round(0.6 * n) - 1, round(0.6 * n) + 3, n - 1, n]
    np.testing.assert_allclose([float(schedule.learning_rate(cfg, s)) for s in steps],
                               [_ref(s, 1.0, 5, round(0.6 * n), n, 0.1) for s in steps], rtol=1e-6)
    assert schedule.notes(cfg, n) == []
  with pytest.raises(OptimConfigError, match="total_steps"):
    schedule.boundaries(OptimConfig(schedule_unit="fraction", decay_start=0.5, decay_end=1.0))
  with pytest.raises(OptimConfigError, match="fractions of the run"):
    OptimConfig(schedule_unit="fraction", decay_start=0.5, decay_end=300, total_steps=10)


def test_tiny_config_decays_within_a_shortened_run():
  """configs/tiny.py with --config.train.steps=50: the last step runs near the final rate, and
  the default 300-step run keeps its documented shape (hold to step 180, decay to 300)."""
  import ml_collections  # noqa: F401
  from configs import tiny
  from optim.config import optim_config
  cfg = tiny.get_config()
  cfg.lock()
  assert schedule.boundaries(optim_config(cfg.optim)) == schedule.Boundaries(20, 180, 300)
  cfg.train.steps = 50  # as a command-line override sets it
  ocfg = optim_config(cfg.optim)
  assert schedule.boundaries(ocfg) == schedule.Boundaries(20, 30, 50)
  last = float(schedule.lr_factor(ocfg, 49))
  assert last == pytest.approx(_ref(49, 1.0, 20, 30, 50, 0.1), rel=1e-6) and last < 0.11


def test_absolute_boundaries_outside_the_run_are_named():
  cfg = OptimConfig(lr=1.0, warmup_steps=2, decay_start=180, decay_end=300, schedule_unit="steps")
  (w,) = schedule.notes(cfg, 50)
  assert "never decays" in w and "decay_start = 180" in w and "train.steps = 50" in w
  (w,) = schedule.notes(cfg, 200)
  assert "cut short" in w and "decay_end = 300" in w
  # the factor it reports is the schedule's own value at the last step
  assert f"{float(schedule.lr_factor(cfg, 199)):.3f} × the peak" in w
  assert schedule.notes(cfg, 300) == []


def test_a_run_too_short_for_the_warmup_scales_it():
  """configs/tiny.py with --config.train.steps=20 (issue 32): the 20-step warm-up cannot end
  before the decay starts at 0.6 × 20 = step 12, so it is cut to 12 steps, and one note says so;
  an absolute schedule keeps refusing a warm-up past its decay start."""
  from configs import tiny
  from optim.config import optim_config
  cfg = tiny.get_config()
  cfg.lock()
  cfg.train.steps = 20
  ocfg = optim_config(cfg.optim)
  assert schedule.boundaries(ocfg) == schedule.Boundaries(12, 12, 20, scaled_from=20)
  (note,) = schedule.notes(ocfg, 20)
  assert "optim.warmup_steps = 20" in note and "scaled to 12 steps" in note
  lrs = [float(schedule.learning_rate(ocfg, s)) for s in range(21)]
  np.testing.assert_allclose(lrs, [_ref(s, 3e-3, 12, 12, 20, 0.1) for s in range(21)], rtol=1e-6)
  cfg.train.steps = 300
  assert schedule.notes(optim_config(cfg.optim), 300) == []


def test_a_resume_under_another_schedule_is_named_with_both_rates():
  """A 50-step fractional run resumed with train.steps = 60: the decay moves from 30-50 to 36-60
  and step 51 runs at the new schedule's rate, several times the old one's final rate; the note
  gives both, from the formula. The same schedule gives no note."""
  kw = dict(lr=1.0, warmup_steps=5, decay_start=0.6, decay_end=1.0, schedule_unit="fraction",
            final_lr_fraction=0.1)
  old, new = OptimConfig(total_steps=50, **kw), OptimConfig(total_steps=60, **kw)
  note = schedule.changed(old, new, 50)
  want_new, want_old = _ref(50, 1.0, 5, 36, 60, 0.1), _ref(50, 1.0, 5, 30, 50, 0.1)
  assert "train.steps 50 → 60" in note and "decay over steps 30-50 → 36-60" in note
  assert f"step 51 runs at lr {want_new:.3g}, where the run's schedule gives {want_old:.3g}" in note
  assert f"(×{want_new / want_old:.2f})" in note and "warm-up" not in note
  assert schedule.changed(old, OptimConfig(total_steps=50, **kw), 50) is None
