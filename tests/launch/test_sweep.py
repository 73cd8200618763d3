"""Learning-rate sweeps (`launch/sweep.py`, `launch.ladder --sweep`): stages, best rates, the
edge flag and the tokens-to-target ratio, on synthetic finished runs (no training)."""

from __future__ import annotations

import json
import math
import os

import pytest

from configs import ladder as ladder_cfg
from launch import ladder, ladder_jobs, sweep


def _spec():
  return ladder_cfg.get_config("micro")


def test_stage_one_is_every_size_chain_and_rate_and_each_point_config_builds():
  spec = _spec()
  points = ladder.plan(spec, False, True)
  assert [(p.chain, p.lr) for p in points] == [(c, lr) for c in ("adamw", "muon")
                                                for lr in (1e-3, 3e-3, 1e-2)]
  assert all(p.kind == "sweep" and p.seed == 0 and p.steps == 4 for p in points)
  cfg = ladder_cfg.get_config(points[-1].arg)
  assert cfg.optim.chain == "muon" and cfg.optim.lr == 1e-2
  assert cfg.train.eval_every == 2            # steps 4 / evals 2
  ladder.validate(os.path.join(ladder.REPO, "configs", "ladder.py"), points[:1])
  with pytest.raises(ValueError, match="unknown ablation"):
    ladder_cfg.get_config("micro/L2d32/4/sgd_lr0.1")


def _row(size, chain, lr, seed, loss, curve=(), tokens=1000.0):
  return dict(kind="sweep", status="done", size=size, chain=chain, lr=lr, seed=seed,
              ablation=sweep.arm(chain, lr), eval_loss=loss, eval_curve=list(curve), tokens=tokens)


def test_stage_two_retrains_each_best_rate_at_the_other_seeds():
  spec = _spec()
  rows = [_row("L2d32", "muon", 1e-3, 0, 3.0), _row("L2d32", "muon", 3e-3, 0, 2.5),
          _row("L2d32", "muon", 1e-2, 0, 2.7), _row("L2d32", "adamw", 1e-3, 0, 2.9),
          dict(_row("L2d32", "adamw", 3e-3, 0, 1.0), status="failed")]
  more = sweep.stage_two(spec, ladder.Point, rows)
  assert [(p.chain, p.lr, p.seed, p.name) for p in more] == [
      ("adamw", 1e-3, 1, "sweeps/L2d32_adamw_lr0.001_seed1"),
      ("muon", 3e-3, 1, "sweeps/L2d32_muon_lr0.003_seed1")]


def test_table_flags_edges_and_gives_the_winner_and_tokens_to_target():
  muon_curve = [(250.0, 3.2), (500.0, 2.8), (1000.0, 2.4)]
  rows = [_row("L", "muon", 1e-3, 0, 2.6), _row("L", "muon", 2e-3, 0, 2.4, muon_curve),
          _row("L", "muon", 4e-3, 0, 2.5), _row("L", "muon", 2e-3, 1, 2.5, muon_curve),
          _row("L", "adamw", 1e-3, 0, 2.8), _row("L", "adamw", 2e-3, 0, 2.7),
          _row("L", "adamw", 4e-3, 0, 2.6)]
  table = {c["chain"]: c for c in sweep.sweep_table(rows)}
  m, a = table["muon"], table["adamw"]
  assert m["best_lr"] == 2e-3 and not m["edge"]
  assert m["best_loss_mean"] == pytest.approx(2.45) and m["best_loss_spread"] == pytest.approx(0.1)
  assert a["best_lr"] == 4e-3 and a["edge"] and a["best_loss_spread"] is None
  assert m["winner"] == a["winner"] == "muon" and m["margin"] == pytest.approx(2.6 - 2.45)
  # Muon's held-out curve reaches AdamW's 2.6 halfway (in loss) from 500 to 1000 tokens.
  expect = math.exp(math.log(500) + 0.5 * (math.log(1000) - math.log(500))) / 1000
  assert m["tokens_to_target"] == pytest.approx(expect)
  text = sweep.markdown(list(table.values()))
  assert "⚠ at the edge" in text and "warning: the best rate sits at an edge" in text
  assert "L/adamw" in text and "L/muon" not in text.split("warning:")[1]


def test_report_reads_sweep_points_from_a_ladder_directory(tmp_path):
  for chain, lr, loss in (("muon", 1e-3, 2.9), ("muon", 3e-3, 2.5), ("muon", 1e-2, 2.7),
                          ("adamw", 1e-3, 2.8), ("adamw", 3e-3, 2.6), ("adamw", 1e-2, 3.0)):
    pdir = tmp_path / "sweeps" / f"L2d32_{sweep.arm(chain, lr)}_seed0"
    p = ladder.Point(f"sweeps/{pdir.name}", f"micro/L2d32/4/{sweep.arm(chain, lr)}", 0, "sweep",
                     "L2d32", 4, sweep.arm(chain, lr), chain, lr)
    ladder_jobs.write_record(str(pdir), dict(vars(p), status="done", tokens=512, eval_loss=loss,
                                             n_active=1.0, flops_per_token=1.0, compute=1.0))
    with open(pdir / "metrics.jsonl", "w") as f:
      for step, l in ((2, loss + 0.3), (4, loss)):
        f.write(json.dumps({"step": step, "loss": l, "eval/loss": l}) + "\n")
  r = ladder.report(str(tmp_path))
  assert "| L2d32 | muon | 0.001 → 2.9000, 0.003 → 2.5000, 0.01 → 2.7000 | 0.003 |" in r["markdown"]
  assert {c["chain"]: c["winner"] for c in r["sweeps"]} == {"muon": "muon", "adamw": "muon"}
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return
  plots = {os.path.basename(p): p for p in r["plots"]}
  assert os.path.getsize(plots["sweep.png"]) > 1000
