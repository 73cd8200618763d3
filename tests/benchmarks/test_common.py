"""benchmarks/common.py: the step benchmarks' `--set` config overrides; arms timed in turn; timing
in bursts."""

import multiprocessing
import time

import ml_collections
import numpy as np
import pytest

from benchmarks import common
from benchmarks.common import Turns, set_overrides
from configs import small


def test_set_overrides_parse_by_the_replaced_type_and_name_bad_items():
  cfg = small.get_config("s1")
  set_overrides(cfg, ["model.ops.hc_site=reference", "model.remat=false", "train.steps=7",
                      "optim.lr=0.5"])
  assert (cfg.model.ops.hc_site, cfg.model.remat, cfg.train.steps, cfg.optim.lr) == (
      "reference", False, 7, 0.5)
  for item, msg in (("model.ops.no_such_op=kernel", "no config key 'model.ops.no_such_op'"),
                    ("model.remat=maybe", "'maybe' does not parse as bool"),
                    ("train.steps=1.5", "'1.5' does not parse as int"),
                    ("model.remat", "expected key=value")):
    with pytest.raises(SystemExit, match=msg):
      set_overrides(cfg, [item])
  set_overrides(cfg, ["model.remat_saves=projections,experts"])
  assert cfg.model.remat_saves == ("projections", "experts")
  d = ml_collections.ConfigDict({"a": None})
  set_overrides(d, ["a=x"])
  assert d.a == "x"


def _arm(spec, delay, log_path):
  """One arm: `delay` s of "compiling", then its timed block, logged as (start, end, ready)."""
  time.sleep(delay)
  ready = time.time()
  with Turns(spec, wait_s=30).turn(0):
    start = time.time()
    time.sleep(0.3)
    end = time.time()
  with open(log_path, "a") as f:
    f.write(f"{start} {end} {ready}\n")


def _dies(spec):
  """An arm that registers and dies before its program is compiled (out of memory)."""
  Turns(spec, wait_s=30)
  raise SystemExit(1)


def _run(tmp_path, dying: int, delays) -> tuple[list, list]:
  """`dying` arms that die and one `_arm` per delay, all sharing one DIR: (exit codes, sorted
  (start, end, ready) spans of the arms that timed)."""
  spec, log = f"{tmp_path / 'turn'}:{dying + len(delays)}", tmp_path / "log"
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_dies, args=(spec,)) for _ in range(dying)] + [
      ctx.Process(target=_arm, args=(spec, d, log)) for d in delays]
  for p in procs:
    p.start()
  for p in procs:
    p.join(60)
  spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
  return [p.exitcode for p in procs], spans


def test_turns_wait_for_every_arm_then_time_one_at_a_time(tmp_path):
  # Three processes that finish "compiling" at 0, 0.2 and 1.0 s: no timed block starts before the
  # last is ready, and no two overlap.
  codes, spans = _run(tmp_path, 0, (0.0, 0.2, 1.0))
  assert codes == [0, 0, 0]
  assert len(spans) == 3 and spans[0][0] >= max(r for _, _, r in spans)
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
  with pytest.raises(SystemExit, match="DIR:N"):
    Turns("no_count")


def test_turns_do_not_wait_for_an_arm_that_died(tmp_path):
  t0 = time.time()
  codes, spans = _run(tmp_path, 1, (0.0, 0.5))
  assert codes == [1, 0, 0]
  assert len(spans) == 2 and spans[1][1] < t0 + 20    # not the 30 s wait
  assert spans[0][0] >= max(r for _, _, r in spans) and spans[0][1] <= spans[1][0]


def test_time_calls_times_bursts_and_rejects_an_empty_one():
  """A burst of calls is timed as one wait; its time is divided by its calls; burst 0 is refused."""
  calls = []

  def fn(x):
    calls.append(1)
    return x + 1

  x = np.ones(4, np.float32)
  seconds, first = common.time_calls(fn, x, reps=3, burst=4)
  assert len(calls) == 1 + 3 * 4 and seconds >= 0 and first >= 0
  calls.clear()
  common.time_calls(fn, x, reps=2)           # the CPU backend: one call a burst, no probe call
  assert len(calls) == 1 + 2
  calls.clear()
  with pytest.raises(ValueError, match="burst must be at least 1 call, got 0"):
    common.time_calls(fn, x, reps=1, burst=0)
  assert not calls                           # refused before any call
