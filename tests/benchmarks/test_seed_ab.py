"""benchmarks/seed_ab.py: seeds paired by name, the last held-out loss of each run, the verdict."""

import json
import statistics

from benchmarks import seed_ab


def _run(root, name, losses):
  d = root / name
  d.mkdir()
  with open(d / "metrics.jsonl", "w") as f:
    for step, v in enumerate(losses):
      f.write(json.dumps({"step": step, "loss": 9.0}) + "\n")
      f.write(json.dumps({"step": step, "eval/loss": v}) + "\n")


def test_paired_difference_and_verdicts(tmp_path, capsys):
  a = {0: 3.10, 1: 3.20, 2: 3.05, 3: 3.15}
  shift = {0: 0.010, 1: -0.004, 2: 0.006, 3: 0.000}
  for s in a:
    _run(tmp_path, f"f32_seed{s}", [9.0, a[s]])
    _run(tmp_path, f"bf16_seed{s}", [9.0, a[s] + shift[s]])
  _run(tmp_path, "bf16_seed7", [9.0, 1.0])          # no partner: left out
  r = seed_ab.compare(seed_ab.arm(str(tmp_path / "f32_seed*"), "eval/loss"),
                      seed_ab.arm(str(tmp_path / "bf16_seed*"), "eval/loss"))
  assert r["seeds"] == [0, 1, 2, 3]
  d = list(shift.values())
  assert abs(r["mean"] - statistics.fmean(d)) < 1e-12
  assert abs(r["se"] - statistics.stdev(d) / 2) < 1e-12
  assert r["within_noise"]                           # 0.003 ± 0.003 against a 0.065 spread
  assert seed_ab.main(["--a", str(tmp_path / "f32_seed*"), "--b",
                       str(tmp_path / "bf16_seed*")]) == 0
  assert "within seed noise" in capsys.readouterr().out

  for s in a:                                        # B consistently 0.1 lower
    _run(tmp_path, f"low_seed{s}", [9.0, a[s] - 0.1 + shift[s] / 10])
  assert seed_ab.main(["--a", str(tmp_path / "f32_seed*"), "--b", str(tmp_path / "low_seed*")]) == 0
  out = capsys.readouterr().out
  assert "verdict: B lower by 0.09" in out


def test_no_common_seed_is_an_error(tmp_path, capsys):
  _run(tmp_path, "x_seed0", [3.0])
  _run(tmp_path, "y_seed1", [3.0])
  assert seed_ab.main(["--a", str(tmp_path / "x_seed*"), "--b", str(tmp_path / "y_seed*")]) == 2
  assert "no seed in both arms" in capsys.readouterr().err


def test_one_common_seed_gives_no_verdict(tmp_path, capsys):
  _run(tmp_path, "x_seed0", [3.0])
  _run(tmp_path, "y_seed0", [2.9])
  assert seed_ab.main(["--a", str(tmp_path / "x_seed*"), "--b", str(tmp_path / "y_seed*")]) == 0
  out = capsys.readouterr().out
  assert "verdict: none yet" in out and "lower by" not in out
