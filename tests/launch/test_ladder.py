"""Scaling ladders (issue 17): `launch.ladder`, `launch.scaling_fit` and the ablation switches of
`configs/ladder.py`.

* the fits recover known laws exactly and the frontier is the lower envelope;
* the report tables every point, lists a failed one with its log, fits the finished ones, and
  gives each ablation's loss difference against the baseline of its seed;
* an invalid grid point stops the ladder before any run;
* the :gpu grid's points and ablations take the tuned table's rates, an unswept size is flagged in
  its records and the report, `gpu_lr2e-3` is the grid as it ran; a done point whose run trained
  at another rate (from its record, config.json or logged schedule) is marked stale, left out of
  the fits and rerun afresh;
* a two-point micro ladder runs end to end: a failing point is recorded with its log, a rerun
  skips the finished point and resumes the other, a third run reruns nothing;
* each ablation switch changes the model as intended (dense attention sees every earlier token;
  no shared decoder KV; no Engram; the plain residual has no mHC parameters; QAT changes the
  logits; the candidate pool has a source and a consumer; the AdamW arm changes the optimizer
  chain only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import ladder as ladder_cfg
from configs.common import base_config, model_config
from dsv41_jax import model as M, testing
from dsv41_jax.layer_plan import build_layer_plan
from launch import ladder, ladder_jobs, scaling_fit
from launch.step import model_inputs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.py")
TIMEOUT = 600


# --- fits -----------------------------------------------------------------------------------------

def test_power_law_fit_recovers_the_law_and_frontier_is_the_lower_envelope():
  C = np.geomspace(1e12, 1e16, 7)
  L = 40.0 * C ** -0.12 + 1.7
  f = scaling_fit.fit_power_law(C, L)
  np.testing.assert_allclose([f.params["a"], f.params["b"], f.params["c"]], [40.0, 0.12, 1.7],
                             rtol=1e-6)
  assert f.r2 > 1 - 1e-12 and np.max(np.abs(f.residuals)) < 1e-8

  # Noisy: c > 0 is interior, so the least-squares residuals sum to zero (the constant column).
  noisy = L + np.random.default_rng(0).normal(0, 0.01, L.shape)
  g = scaling_fit.fit_power_law(C, noisy)
  assert g.params["c"] > 0 and abs(sum(g.residuals)) < 1e-9 and 0.9 < g.r2 < 1

  C2 = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
  L2 = np.array([5.0, 5.5, 4.0, 4.2, 3.9])
  np.testing.assert_array_equal(scaling_fit.frontier(C2, L2), [0, 2, 4])
  with pytest.raises(ValueError, match="3 parameters"):
    scaling_fit.fit_power_law(C[:2], L[:2])


def test_chinchilla_fit_recovers_the_law():
  N, D = (a.ravel() for a in np.meshgrid(np.geomspace(1e5, 1e7, 3), np.geomspace(1e5, 1e7, 3)))
  L = 1.5 + 30.0 * N ** -0.3 + 80.0 * D ** -0.35
  f = scaling_fit.fit_chinchilla(N, D, L)
  got = [f.params[k] for k in ("E", "A", "alpha", "B", "beta")]
  np.testing.assert_allclose(got, [1.5, 30.0, 0.3, 80.0, 0.35], rtol=1e-5)
  np.testing.assert_allclose(f.params["n_opt_exponent"], 0.35 / 0.65, rtol=1e-5)
  np.testing.assert_allclose(scaling_fit.predict_chinchilla(f, N, D), L, rtol=1e-9)


# --- report ---------------------------------------------------------------------------------------

def _fake_point(root, name, kind, size, steps, n, status="done", loss=None, seed=0, ablation="",
                epochs=None):
  pdir = os.path.join(root, name)
  os.makedirs(pdir)
  tokens = steps * 1024
  rec = dict(name=name, arg=f"cpu/{size}/{steps}", seed=seed, kind=kind, size=size, steps=steps,
             ablation=ablation, layers=8, d=32, n_active=n, flops_per_token=6 * n,
             tokens=tokens, compute=6 * n * tokens, command="-m launch.train ...",
             log=os.path.join(pdir, "train.log"), status=status, grid="cpu")
  with open(os.path.join(pdir, "point.json"), "w") as f:
    json.dump(rec, f)
  if status == "done":
    with open(os.path.join(pdir, "metrics.jsonl"), "w") as f:
      for s in range(10, steps + 1, 10):
        passes = {} if epochs is None else {"data/epochs/text": epochs * s / steps}
        f.write(json.dumps({"step": s, "loss": loss + 1.0 / s, **passes}) + "\n")
      f.write(json.dumps({"step": steps, "eval/loss": loss, "eval/bits_per_byte": loss / 2})
              + "\n")


def test_report_fits_finished_points_lists_failed_and_tables_ablations(tmp_path):
  root = str(tmp_path / "ladder")
  law = lambda n, d: 1.5 + 30.0 * n ** -0.3 + 80.0 * d ** -0.35
  for n in (1e5, 1e6, 1e7):
    for steps in (100, 1000, 10000):
      _fake_point(root, f"n{n:.0e}_{steps}", "grid", f"n{n:.0e}", steps, n,
                  loss=law(n, steps * 1024), epochs=None if steps == 100 else steps / 1000)
  _fake_point(root, "n1e+08_100", "grid", "n1e+08", 100, 1e8, status="failed")
  for seed, base, dense in ((0, 3.0, 2.9), (1, 3.1, 3.05)):
    _fake_point(root, f"ablations/baseline_seed{seed}", "ablation", "s", 100, 1e5, loss=base,
                seed=seed)
    _fake_point(root, f"ablations/dense_attention_seed{seed}", "ablation", "s", 100, 1e5,
                loss=dense, seed=seed, ablation="dense_attention")
  out = str(tmp_path / "out")
  r = ladder.report(root, out)

  rows = {row["name"]: row for row in r["rows"]}
  assert len(rows) == 14 and rows["n1e+08_100"]["status"] == "failed"
  assert f"failed ({os.path.join(root, 'n1e+08_100', 'train.log')})" in r["markdown"]
  assert "n1e+08_100" not in r["fits"]["points_fitted"] and len(r["fits"]["points_fitted"]) == 9
  # passes over the training text, from the last record that has them; over one is marked
  assert rows["n1e+07_10000"]["text_epochs"] == 10.0 and rows["n1e+05_100"]["text_epochs"] is None
  table = {line.split(" |")[0].strip("| *"): line for line in r["markdown"].splitlines()
           if line.startswith("| n")}
  assert "| 10.00 ! |" in table["n1e+07_10000"] and "| 1.00 |" in table["n1e+07_1000"]
  assert "| - |" in table["n1e+05_100"]
  assert "! read its training text more than once" in r["markdown"]
  gf = r["fits"]["grid_fit"]
  assert gf["r2"] > 1 - 1e-10
  np.testing.assert_allclose(gf["params"]["alpha"], 0.3, rtol=1e-5)
  # The frontier: lower envelope of (C, L), fitted by L(C) on exactly those points.
  assert r["fits"]["frontier_fit"]["points"] == r["fits"]["frontier"]
  C = np.array([rows[n]["compute"] for n in r["fits"]["frontier"]])
  L = np.array([rows[n]["eval_loss"] for n in r["fits"]["frontier"]])
  assert np.all(np.diff(C) > 0) and np.all(np.diff(L) < 0)

  (a,) = r["ablations"]
  np.testing.assert_allclose([a["delta_loss_mean"], a["delta_loss_min"], a["delta_loss_max"]],
                             [-0.075, -0.1, -0.05], rtol=1e-12)
  assert a["seeds"] == [0, 1] and a["baseline_seeds"] == [0, 1]
  # |Δ| of 0.05 at seed 1 is under the baseline's own spread of 0.1
  np.testing.assert_allclose(a["baseline_spread"], 0.1, rtol=1e-12)
  assert a["verdict"] == "within noise" and "| within noise |" in r["markdown"]
  with open(os.path.join(out, "ladder.csv")) as f:
    assert len(f.read().strip().splitlines()) == 15  # header + 14 points
  with open(os.path.join(out, "ladder.json")) as f:
    assert json.load(f)["fits"]["grid_fit"]["n_points"] == 9
  # The default output is the ladder directory itself; a second report reads past the first's files.
  ladder.report(root)
  assert len(ladder.report(root)["rows"]) == 14
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return
  assert sorted(os.path.basename(p) for p in r["plots"]) == [
      "frontier.png", "loss_curves.png", "residuals.png"]
  assert all(os.path.getsize(p) > 1000 for p in r["plots"])


def test_ablation_verdict_needs_a_spread_and_one_sign():
  assert ladder.ablation_verdict([0.3], 0.0, 1) == "one baseline seed: no spread yet"
  assert ladder.ablation_verdict([0.05, 0.07], 0.04, 2) == "beyond the seed spread"
  assert ladder.ablation_verdict([-0.05, -0.07], 0.04, 2) == "beyond the seed spread"
  assert ladder.ablation_verdict([0.05, 0.03], 0.04, 2) == "within noise"   # one |Δ| under it
  assert ladder.ablation_verdict([0.5, -0.5], 0.04, 2) == "within noise"    # the sign flips
  assert ladder.ablation_verdict([0.05], 0.04, 2) == "beyond the seed spread (one seed so far)"
  assert ladder.ablation_verdict([0.01], 0.04, 2) == "within noise (one seed so far)"


# --- the ladder end to end ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env():
  # One CPU device (the suite's conftest forces 8): the micro grid's batch of 4 rows is unsplit.
  e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS="")
  e.pop("JAX_COORDINATOR_ADDRESS", None)
  return e


def _ladder(env, *args):
  p = subprocess.run([sys.executable, "-m", "launch.ladder", *args], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=TIMEOUT)
  return p.returncode, p.stdout + p.stderr


def test_invalid_point_is_reported_before_any_run(tmp_path, env):
  bad = tmp_path / "bad_ladder.py"
  bad.write_text(textwrap.dedent("""
      from configs import ladder
      ladder.GRIDS["bad"] = dict(ladder.GRIDS["micro"], sizes={"L2d32": (2, 32), "L9d32": (9, 32)})
      get_config = ladder.get_config
      """))
  work = tmp_path / "work"
  rc, out = _ladder(env, f"--config={bad}:bad", f"--workdir={work}")
  assert rc == 2, out
  assert "2 of 4 ladder points have an invalid config; nothing was run" in out
  assert "L9d32_3" in out and "L9d32_6" in out and "layers (9) must be even" in out
  assert not work.exists()


def test_list_prints_lines_a_shell_runs_as_the_ladder_would(tmp_path, env):
  """`--list` prints one shell line per point with the repository, the grid's XLA flags and this
  interpreter (issue 33: the lines lacked all three); pasted into bash from elsewhere, with a
  misspelt override appended, a line reaches launch.train's one-line config error."""
  rc, out = _ladder(env, "--config=configs/ladder.py:micro", f"--workdir={tmp_path / 'w'}", "--list")
  assert rc == 0, out
  lines = out.strip().splitlines()
  assert len(lines) == 2
  for line, steps in zip(lines, (3, 6)):
    words = shlex.split(line)
    assert words[:3] == ["cd", REPO, "&&"]
    assert words[3] == f"XLA_FLAGS={ladder_cfg.FASTER_CPU}"
    assert words[4:7] == [sys.executable, "-m", "launch.train"]
    assert f"--workdir={tmp_path / 'w'}/L2d32_{steps}" in words
  p = subprocess.run(["bash", "-c", lines[0] + " --config.train.stepz=1"], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=TIMEOUT)
  assert p.returncode == 2 and p.stderr.startswith("error: a --config override"), p.stderr[-2000:]
  assert not (tmp_path / "w").exists()


def test_list_warns_before_a_stale_points_line(tmp_path, env):
  """A point whose directory holds a run at another rate than its config's gets a comment line
  before its command (pasted alone, launch.train would resume that run); a point at the config's
  rate gets none."""
  work = tmp_path / "w"
  ladder_jobs.write_record(str(work / "L2d32_3"), dict(
      name="L2d32_3", kind="grid", size="L2d32", steps=3, chain="muon", lr=1e-2, status="done",
      eval_loss=9.0))
  ladder_jobs.write_record(str(work / "L2d32_6"), dict(
      name="L2d32_6", kind="grid", size="L2d32", steps=6, chain="muon", lr=3e-3, status="done",
      eval_loss=9.0))
  rc, out = _ladder(env, "--config=configs/ladder.py:micro", f"--workdir={work}", "--list")
  assert rc == 0, out
  lines = out.strip().splitlines()
  assert len(lines) == 3, out
  assert lines[0] == (f"# L2d32_3: stale: ran at lr 1e-2, config says 3e-3; move {work}/L2d32_3 "
                      f"aside before running this line (the ladder moves it to {work}/stale/ itself)")
  assert "--workdir=" + str(work / "L2d32_3") in lines[1]
  assert "--workdir=" + str(work / "L2d32_6") in lines[2]


def test_only_selects_points_by_pattern_and_rejects_a_pattern_matching_none():
  """`--only` keeps the plan's order; a sweep's second-stage names may be named before the first
  stage ran; a pattern that matches nothing lists the names (pure: no runs)."""
  spec = ladder_cfg.get_config("gpu")
  grid = ladder.plan(spec, False)
  got = ladder.select(grid, ["L16d512_800", "L8d256_*"])
  assert [p.name for p in got] == ["L8d256_200", "L8d256_400", "L8d256_800", "L16d512_800"]
  assert ladder.select(grid, None) == grid
  first = ladder.plan(spec, False, True)
  later = ladder.later_points(spec, first, True)
  assert len(later) == len(first) and all(p.name.endswith("_seed1") and p.seed == 1 for p in later)
  assert ladder.select(first, ["sweeps/*_seed1"], later) == []
  with pytest.raises(ladder_jobs.LadderError, match="L99_800,x: matches no point.*L8d256_200"):
    ladder.select(grid, ["L99_800", "L8d256_200", "x"])


def test_gpu_points_and_ablations_run_at_the_tuned_table_and_an_unswept_size_is_flagged():
  """One table of tuned rates (`GRIDS["gpu"]["lr"]`, per chain and size) gives the :gpu grid's
  points and ablations their peak rate; L16d512, never swept, takes L12d384's and is flagged
  untuned; `gpu_lr2e-3` is the grid as its 9 points ran (2e-3 everywhere, nothing else changed);
  the CPU grid keeps its one rate."""
  table = ladder_cfg.GRIDS["gpu"]["lr"]
  assert table == {"muon": {"L8d256": 4e-3, "L12d384": 8e-3},
                   "adamw": {"L8d256": 4e-3, "L12d384": 2e-3}}
  spec = ladder_cfg.get_config("gpu")
  borrowed = {"L8d256": "L8d256", "L12d384": "L12d384", "L16d512": "L12d384"}
  for p in ladder.plan(spec, False):
    cfg = ladder_cfg.get_config(p.arg)
    assert cfg.optim.chain == "muon" and cfg.optim.lr == table["muon"][borrowed[p.size]], p.arg
    old = ladder_cfg.get_config(p.arg.replace("gpu/", "gpu_lr2e-3/"))
    assert old.optim.lr == 2e-3 and dict(old.optim, lr=cfg.optim.lr) == dict(cfg.optim)
    assert old.to_dict().keys() == cfg.to_dict().keys()
    assert all(old[k] == cfg[k] for k in ("model", "data", "train", "mesh")), p.arg
  points = ladder.plan(spec, True)
  assert {p.arg.split("/")[-1] for p in points} == {"baseline", *spec.ablations}
  for p in points:
    cfg = ladder_cfg.get_config(p.arg)
    chain = cfg.optim.chain
    assert (chain == "adamw") == p.arg.endswith("/adamw"), p.arg
    assert cfg.optim.lr == table[chain][spec.ablation_size], p.arg
  # The grid point at the ablation size and budget is the ablation baseline's run.
  grid_point = ladder_cfg.get_config(f"gpu/{spec.ablation_size}/{spec.ablation_steps}")
  assert dict(grid_point.optim) == dict(ladder_cfg.get_config(
      f"gpu/{spec.ablation_size}/{spec.ablation_steps}/baseline").optim)
  assert ladder_cfg.peak_lr("gpu", "L16d512", "adamw") == (
      2e-3, "untuned: no sweep at L16d512, L12d384's rate")
  assert dict(spec.untuned) == {"L16d512": "untuned: no sweep at L16d512, L12d384's rate"}
  assert not dict(ladder_cfg.get_config("gpu_lr2e-3").untuned)
  assert not dict(ladder_cfg.get_config("cpu").untuned)
  assert ladder_cfg.get_config("cpu/L10d32/60/adamw").optim.lr == ladder_cfg.GRIDS["cpu"]["lr"]
  assert ladder_cfg.get_config("cpu/L8d32/60").optim.lr == ladder_cfg.GRIDS["cpu"]["lr"]


def test_records_take_the_configs_rate_and_an_unswept_sizes_note(tmp_path, monkeypatch):
  """The ladder writes into each record the chain and peak rate its config gives and, at an
  untuned size, the note; a done point that --only leaves out but whose run trained at another
  rate is marked stale. Pure: the runs are not started."""
  got = {}
  def no_run(points, commands, described, *args, **kwargs):
    got.update(described)
    return []
  monkeypatch.setattr(ladder_jobs, "run", no_run)
  work = tmp_path / "work"
  ladder_jobs.write_record(str(work / "L12d384_200"), dict(
      name="L12d384_200", kind="grid", size="L12d384", steps=200, chain="muon", lr=2e-3,
      status="done", eval_loss=3.0))
  lines = []
  ladder.run_ladder("configs/ladder.py:gpu", str(work), log=lines.append,
                    only=["L8d256_200", "L16d512_200"])
  assert sorted(got) == ["L16d512_200", "L8d256_200"]
  assert (got["L8d256_200"]["chain"], got["L8d256_200"]["lr"], got["L8d256_200"]["lr_note"]) == (
      "muon", 4e-3, "")
  assert (got["L16d512_200"]["lr"], got["L16d512_200"]["lr_note"]) == (
      8e-3, "untuned: no sweep at L16d512, L12d384's rate")
  stale = "stale: ran at lr 2e-3, config says 8e-3"
  assert ladder.read_record(str(work / "L12d384_200"))["status"] == stale
  assert lines == [f"L12d384_200: {stale}; not selected, left out of the fits until it runs"]


def _done_record(pdir, chain="", lr=0.0):
  """A done grid point's record; by default as the ladder wrote it before records held the rate,
  chain "" and lr 0.0 (the 9 :gpu points of benchmarks/ladder/gpu, build/ladder_prev)."""
  rec = dict(name=os.path.basename(pdir), arg="gpu/L8d256/200", seed=0, kind="grid",
             size="L8d256", steps=200, ablation="", chain=chain, lr=lr, status="done",
             eval_loss=3.19)
  ladder_jobs.write_record(pdir, rec)
  return rec


def test_an_old_records_rate_comes_from_its_config_or_its_logged_schedule(tmp_path):
  """A record without the rate: the run's config.json, else the peak of the schedule it logged
  (float32, as metrics.jsonl holds it), else unknown, which is stale."""
  want = dict(chain="muon", lr=4e-3)
  logged = tmp_path / "logged"
  rec = _done_record(str(logged))
  with open(logged / "metrics.jsonl", "w") as f:
    for step, lr in ((10, 0.00044000003254041076), (50, 0.0020000000949949026),
                     (150, 0.0020000000949949026), (200, 1e-5)):
      f.write(json.dumps({"step": step, "lr/muon": lr}) + "\n")
  assert ladder_jobs.ran_at(rec, str(logged)) == (None, 2e-3, "metrics.jsonl")
  assert ladder_jobs.stale_reason(rec, str(logged), want) == (
      "stale: ran at lr 2e-3, config says 4e-3")
  assert ladder_jobs.stale_reason(rec, str(logged), dict(chain="adamw", lr=2e-3)) == ""  # chain ?
  configured = tmp_path / "configured"
  rec = _done_record(str(configured))
  (configured / "config.json").write_text(json.dumps({"optim": {"chain": "adamw", "lr": 4e-3}}))
  assert ladder_jobs.ran_at(rec, str(configured)) == ("adamw", 4e-3, "config.json")
  assert ladder_jobs.stale_reason(rec, str(configured), want) == (
      "stale: ran adamw at lr 4e-3, config says muon at 4e-3")
  bare = tmp_path / "bare"
  rec = _done_record(str(bare))
  assert ladder_jobs.ran_at(rec, str(bare)) == (None, None, None)
  assert ladder_jobs.stale_reason(rec, str(bare), want).startswith("stale: ran at an unknown lr")
  assert ladder_jobs.format_lr(0.016) == "1.6e-2" and ladder_jobs.format_lr(2.5e-4) == "2.5e-4"


def test_a_stale_done_point_is_marked_and_rerun_afresh_and_a_current_one_skipped(tmp_path):
  """`ladder_jobs.run`: a done point whose run trained at another rate than its config gives is
  marked stale, its directory moved to DIR/stale/ (so the new run does not resume its
  checkpoint) and the point started; a done point at its config's rate is skipped; a stale mark
  goes back to done once the config agrees again."""
  work = tmp_path / "work"
  old = _done_record(str(work / "A_200"), chain="muon", lr=2e-3)
  (work / "A_200" / "checkpoints").mkdir()
  _done_record(str(work / "B_200"), chain="muon", lr=4e-3)
  point = lambda name: ladder.Point(name, f"g/A/{name}", 0, "grid", "A", 200)
  points = [point("A_200"), point("B_200")]
  commands = {p.name: [sys.executable, "-c", "pass"] for p in points}
  want = {p.name: dict(chain="muon", lr=4e-3) for p in points}
  lines = []
  records = ladder_jobs.run(points, commands, want, "g", str(work), dict(os.environ), lines.append)
  assert lines[0] == ("[1/2] A_200: stale: ran at lr 2e-3, config says 4e-3; its run (stale: ran "
                      f"at lr 2e-3, config says 4e-3) moved to {work}/stale/A_200.lr2e-3, "
                      "starting afresh")
  assert "[2/2] B_200: done, skipped" in lines
  moved = ladder.read_record(str(work / "stale" / "A_200.lr2e-3"))
  assert moved["eval_loss"] == old["eval_loss"]
  assert (work / "stale" / "A_200.lr2e-3" / "checkpoints").is_dir()
  assert not (work / "A_200" / "checkpoints").exists()
  assert records[0]["lr"] == 4e-3 and records[0]["status"] == "failed"   # ran, logged no eval
  # A stale mark left by a run that did not restart the point is undone when the config agrees.
  _done_record(str(work / "C_200"), chain="muon", lr=2e-3)
  assert ladder_jobs.reconcile(str(work / "C_200"), dict(chain="muon", lr=4e-3))[0]["status"] == (
      "stale: ran at lr 2e-3, config says 4e-3")
  rec, why = ladder_jobs.reconcile(str(work / "C_200"), dict(chain="muon", lr=2e-3))
  assert why == "" and rec["status"] == ladder.read_record(str(work / "C_200"))["status"] == "done"


def test_report_labels_each_points_rate_and_fits_no_stale_point(tmp_path):
  """The report gives each point's peak rate (° read from its logged schedule, † untuned, with
  the footnotes), leaves a stale point out of the fits with its status, and warns when the fitted
  points of one size ran at different rates."""
  root = str(tmp_path / "ladder")
  for size, n in (("S", 1e5), ("M", 1e6), ("L", 1e7)):
    for steps in (100, 1000):
      _fake_point(root, f"{size}_{steps}", "grid", size, steps, n,
                  loss=3.0 - np.log10(n * steps) / 10)
  for name, fields in (("S_100", dict(chain="muon", lr=4e-3)),
                       ("M_100", dict(chain="muon", lr=8e-3)),
                       ("L_100", dict(chain="muon", lr=8e-3, lr_note="untuned: no sweep at L")),
                       ("L_1000", dict(chain="muon", lr=8e-3, lr_note="untuned: no sweep at L")),
                       ("M_1000", dict(chain="muon", lr=2e-3,
                                       status="stale: ran at lr 2e-3, config says 8e-3"))):
    path = os.path.join(root, name, "point.json")
    with open(path) as f:
      rec = json.load(f)
    with open(path, "w") as f:
      json.dump(dict(rec, **fields), f)
  with open(os.path.join(root, "S_1000", "metrics.jsonl"), "a") as f:   # an old record: 0.0
    f.write(json.dumps({"step": 50, "lr/muon": 0.0020000000949949026}) + "\n")
  r = ladder.report(root, str(tmp_path / "out"))
  rows = {row["name"]: row for row in r["rows"]}
  assert sorted(r["fits"]["points_fitted"]) == ["L_100", "L_1000", "M_100", "S_100", "S_1000"]
  assert rows["S_1000"]["lr"] == 2e-3 and rows["S_1000"]["lr_from"] == "metrics.jsonl"
  table = {line.split(" |")[0].strip("| *"): line for line in r["markdown"].splitlines()
           if line.startswith("| ")}
  assert "| 8e-3† |" in table["L_100"] and "| 2e-3° |" in table["S_1000"]
  assert "| 4e-3 |" in table["S_100"]
  assert "stale: ran at lr 2e-3, config says 8e-3 (" in table["M_1000"]
  assert "† L: untuned: no sweep at L" in r["markdown"]
  assert "° peak lr read from the schedule the run logged" in r["markdown"]
  assert ("peak lr of the fitted points: L 8e-3, M 8e-3, S 4e-3 and 2e-3 (warning: mixed rates "
          "at S: the fits mix them)") in r["markdown"]


def test_second_stage_plans_from_every_finished_first_stage_point(tmp_path):
  """A call whose `--only` runs some first-stage points and names second-stage ones plans the
  second stage from this call's records and those earlier calls left in the workdir (2026-12-05: a
  call that ran two L12d384 points could not start L8d256's seed-1 points). Pure: no runs."""
  spec = ladder_cfg.get_config("gpu")
  first = ladder.plan(spec, False, True)
  def rec(size, chain, lr, loss, status="done"):
    name = f"sweeps/{size}_{chain}_lr{lr}_seed0"
    return dict(name=name, kind="sweep", status=status, seed=0, size=size, chain=chain, lr=lr,
                ablation=f"{chain}_lr{lr}", eval_loss=loss)
  on_disk = [rec("L8d256", "muon", 0.004, 2.58), rec("L8d256", "muon", 0.008, 2.59),
             rec("L8d256", "adamw", 0.004, 2.73), rec("L12d384", "adamw", 0.002, 2.64),
             rec("L8d256", "adamw", 0.002, 1.0, status="failed")]
  for r in on_disk:
    ladder_jobs.write_record(str(tmp_path / r["name"]), r)
  this_call = [rec("L12d384", "muon", 0.008, 2.50)]
  got = ladder.finished_first(first, this_call, str(tmp_path))
  assert sorted(r["name"] for r in got) == sorted(r["name"] for r in on_disk[:4] + this_call)
  second = [p.name for p in ladder.sweep.stage_two(spec, ladder.Point, got)]
  assert second == ["sweeps/L12d384_adamw_lr0.002_seed1", "sweeps/L12d384_muon_lr0.008_seed1",
                    "sweeps/L8d256_adamw_lr0.004_seed1", "sweeps/L8d256_muon_lr0.004_seed1"]


def test_micro_ladder_end_to_end_with_failure_and_resume(tmp_path, env):
  # First pass: the 6-step point cannot build its mesh (3 data shards on one device) and fails.
  flaky = tmp_path / "flaky_ladder.py"
  flaky.write_text(textwrap.dedent("""
      from configs import ladder

      def get_config(arg=None):
        cfg = ladder.get_config(arg)
        if arg.endswith("/6"):
          cfg.mesh.data = 3
        return cfg
      """))
  work = str(tmp_path / "work")
  rc, out = _ladder(env, f"--config={flaky}:micro", f"--workdir={work}")
  assert rc == 0, out
  first = ladder.read_record(os.path.join(work, "L2d32_3"))
  failed = ladder.read_record(os.path.join(work, "L2d32_6"))
  assert first["status"] == "done" and np.isfinite(first["eval_loss"])
  assert failed["status"] == "failed" and failed["returncode"] == 2
  with open(failed["log"]) as f:
    assert "error: config.mesh" in f.read()
  assert f"failed ({failed['log']})" in out
  metrics_file = os.path.join(work, "L2d32_3", "metrics.jsonl")
  before = open(metrics_file).read()

  # Second pass (the real config): the finished point is skipped, the failed one runs.
  rc, out = _ladder(env, "--config=configs/ladder.py:micro", f"--workdir={work}")
  assert rc == 0, out
  assert "[1/2] L2d32_3: done, skipped" in out
  second = ladder.read_record(os.path.join(work, "L2d32_6"))
  assert second["status"] == "done" and second["tokens"] == 6 * 4 * 32
  assert open(metrics_file).read() == before
  # Third pass: nothing left to run; the report redoes the table from the runs.
  rc, out = _ladder(env, "--config=configs/ladder.py:micro", f"--workdir={work}")
  assert rc == 0 and out.count("done, skipped") == 2, out
  rc, out = _ladder(env, f"--report={work}", f"--out={tmp_path / 'report'}")
  assert rc == 0 and "| L2d32_6 * |" in out, out  # * = on the frontier
  with open(tmp_path / "report" / "ladder.json") as f:
    points = {p["name"]: p for p in json.load(f)["points"]}
  assert points["L2d32_6"]["eval_loss"] == second["eval_loss"]


def _slow_config(tmp_path):
  """A ladder config file whose points' processes print "point started" and sleep 2 minutes."""
  slow = tmp_path / "slow_ladder.py"
  slow.write_text(textwrap.dedent("""
      import sys, time
      from configs import ladder

      def get_config(arg=None):
        if sys.argv[0].endswith("train.py"):   # a point's process, not the ladder itself
          print("point started", flush=True)
          time.sleep(120)
        return ladder.get_config(arg)
      """))
  return slow


def _start_ladder(env, *args):
  return subprocess.Popen([sys.executable, "-m", "launch.ladder", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path, text, proc):
  deadline = time.time() + TIMEOUT
  while not (path.exists() and text in path.read_text()):
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
    time.sleep(0.2)


def test_sigterm_stops_the_running_point_and_exits_130(tmp_path, env):
  """SIGTERM (or Ctrl-C) to the ladder stops the running point's process, records the point as
  interrupted and exits 130 with a line saying how to resume; no training process is left over."""
  slow = _slow_config(tmp_path)
  work = tmp_path / "work"
  proc = _start_ladder(env, f"--config={slow}:micro", f"--workdir={work}")
  _wait_for(work / "L2d32_3" / "train.log", "point started", proc)
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=60)[0]
  assert proc.returncode == 130, out
  assert "run the same command again to resume" in out
  record = ladder.read_record(str(work / "L2d32_3"))
  assert record["status"] == "interrupted"
  assert not (work / "L2d32_6").exists()   # nothing after the interrupted point started
  ps = subprocess.run(["pgrep", "-f", str(slow)], capture_output=True, text=True)
  assert ps.stdout.strip() == "", ps.stdout


def test_time_limit_stops_the_running_point_and_exits_75(tmp_path, env):
  """`--time_limit`: at the limit the running point is stopped as on SIGTERM (recorded
  interrupted, no process left), the next is not started, the report is written and the ladder
  exits 75 saying that the same command goes on."""
  slow = _slow_config(tmp_path)
  work = tmp_path / "work"
  t0 = time.time()
  rc, out = _ladder(env, f"--config={slow}:micro", f"--workdir={work}", "--time_limit=15")
  assert rc == 75 and "time limit: 15 s passed: L2d32_3 stopped" in out, out
  assert time.time() - t0 < 60   # not the point's 120 s
  assert "run the same command again to go on" in out and "| L2d32_3 |" in out
  assert ladder.read_record(str(work / "L2d32_3"))["status"] == "interrupted"
  assert not (work / "L2d32_6").exists()
  ps = subprocess.run(["pgrep", "-f", str(slow)], capture_output=True, text=True)
  assert ps.stdout.strip() == "", ps.stdout
  rc, out = _ladder(env, "--config=configs/ladder.py:micro", f"--workdir={work}", "--time_limit=0")
  assert rc == 2 and "--time_limit=0.0: give the seconds the ladder may run, > 0" in out, out


def _finished(pdir, size, steps, seconds, step_times, runs=1, **extra):
  """A done point's record, metrics and log, as a finished run leaves them (`runs`: how often
  the ladder started it)."""
  ladder_jobs.write_record(str(pdir), dict(dict(name=pdir.name, kind="grid", size=size,
                                                steps=steps, ablation="", chain=""), **extra,
                                           status="done", seconds=seconds))
  (pdir / "train.log").write_text("=== a run\n" * runs)
  with open(pdir / "metrics.jsonl", "w") as f:
    for i, t in enumerate(step_times, 1):
      f.write(json.dumps({"step": i, "step_time": t}) + "\n")
    f.write(json.dumps({"step": steps, "eval/loss": 3.0}) + "\n")


def test_time_limit_starts_only_the_points_the_finished_ones_say_will_fit(tmp_path):
  """Each point's time is the finished points of its size at the same --jobs, of its sweep chain
  where there are such (median seconds a step x steps + median seconds outside the steps); one
  that would not fit the time left is not started and the ladder goes on to the next; one with no
  such finished point is started."""
  work = tmp_path / "work"
  _finished(work / "S_3", "S", 3, 100.0, [10.0, 9.0, 12.0])          # 10 s a step, 70 s fixed
  _finished(work / "S_4", "S", 4, 130.0, [11.0, 10.0, 10.0])         # 10 s a step, 90 s fixed
  _finished(work / "S_5x2", "S", 5, 10.0, [1.0], jobs=2)              # shared: not for jobs=1
  _finished(work / "T_9", "T", 9, 5.0, [])                           # no step time: unused
  _finished(work / "T_8", "T", 8, 5.0, [1.0], runs=2)                # resumed: unused
  _finished(work / "sweeps" / "S_adamw_lr0.1", "S", 2, 20.0, [4.0], kind="sweep",
            ablation="adamw_lr0.1", chain="adamw")                  # 4 s a step, 12 s fixed
  timings = ladder_jobs.finished_timings(str(work))
  assert sorted(r["name"] for r, _ in timings) == ["S_3", "S_4", "S_5x2", "S_adamw_lr0.1"]
  point = lambda name, size, steps: ladder.Point(name, f"g/{size}/{steps}", 0, "grid", size, steps)
  sweep = lambda chain: ladder.Point("s", "g/S/6/x", 0, "sweep", "S", 6, f"{chain}_lr0.3", chain, 0.3)
  # The S grid points: each 10 s a step (its median), 70 and 90 s outside the steps: 80 s.
  assert ladder_jobs.estimate_seconds(point("a", "S", 6), 1, timings) == 80.0 + 6 * 10.0
  assert ladder_jobs.estimate_seconds(point("a", "S", 6), 2, timings) == 5.0 + 6 * 1.0
  assert ladder_jobs.estimate_seconds(point("a", "T", 6), 1, timings) is None
  # No S point run 3 at once: 3 x its time alone, an upper bound while they share the device.
  assert ladder_jobs.estimate_seconds(point("a", "S", 6), 3, timings) == 3 * (80.0 + 6 * 10.0)
  assert ladder_jobs.estimate_seconds(point("a", "T", 6), 3, timings) is None
  assert ladder_jobs.estimate_seconds(sweep("adamw"), 1, timings) == 12.0 + 6 * 4.0  # its chain
  assert ladder_jobs.estimate_seconds(sweep("muon"), 1, timings) == pytest.approx(
      statistics.median([20.0 - 2 * 4.0, 70.0, 90.0]) + 6 * 10.0)        # none: all of size S

  # S_2's 100 s fit the 120 s left, but not with the margin for run-to-run spread (120 s).
  assert ladder_jobs.with_margin(100.0) == pytest.approx(120.0)
  points = [point("S_3", "S", 3), point("S_6", "S", 6), point("S_2", "S", 2), point("S_1", "S", 1),
            point("T_2", "T", 2)]
  commands = {p.name: [sys.executable, "-c", "pass"] for p in points}
  lines = []
  records = ladder_jobs.run(points, commands, {p.name: {} for p in points}, "g", str(work),
                            dict(os.environ), lines.append, deadline=time.time() + 120)
  assert [r["status"] for r in records] == ["done", "not started", "not started", "failed",
                                            "failed"], lines
  assert any(l.startswith("[2/5] S_6: not started: needs ~140 s by the finished points of its "
                          "size (164 s with the margin), 1") for l in lines), lines
  assert any(l.startswith("[3/5] S_2: not started: needs ~100 s") for l in lines), lines
  assert not (work / "S_6").exists() and not (work / "S_2").exists()
  assert records[3]["returncode"] == records[4]["returncode"] == 0   # started: ran, no eval


# --- several points at once (--jobs) -------------------------------------------------------------

@pytest.mark.slow  # 63-79 s on the 2-core box (2026-12-03); jobs=1 resume and the --jobs checks stay
def test_jobs_2_stops_on_sigint_resumes_and_gives_the_losses_of_jobs_1(tmp_path, env):
  """--jobs=2: SIGINT to the ladder alone while both points run (the processes then hear only the
  ladder's SIGTERM; `timeout -s INT` and Ctrl-C would also signal them directly) stops both:
  records interrupted, exit 130, no process left. The same command again trains both, each in
  its own work directory, to the same bits as --jobs=1: the same held-out losses and every
  logged training loss."""
  slow = _slow_config(tmp_path)
  work = tmp_path / "jobs2"
  proc = _start_ladder(env, f"--config={slow}:micro", f"--workdir={work}", "--jobs=2")
  for name in ("L2d32_3", "L2d32_6"):
    _wait_for(work / name / "train.log", "point started", proc)
  proc.send_signal(signal.SIGINT)
  out = proc.communicate(timeout=60)[0]
  assert proc.returncode == 130 and "run the same command again to resume" in out, out
  for name in ("L2d32_3", "L2d32_6"):
    record = ladder.read_record(str(work / name))
    assert record["status"] == "interrupted" and record["jobs"] == 2, record
  ps = subprocess.run(["pgrep", "-f", str(slow)], capture_output=True, text=True)
  assert ps.stdout.strip() == "", ps.stdout

  # Resume at --jobs=2 beside a --jobs=1 reference (the two ladders at once: 2 cores).
  ref = tmp_path / "jobs1"
  runs = [_start_ladder(env, "--config=configs/ladder.py:micro", f"--workdir={w}", *extra)
          for w, extra in ((work, ["--jobs=2"]), (ref, []))]
  outs = [r.communicate(timeout=TIMEOUT)[0] for r in runs]
  assert [r.returncode for r in runs] == [0, 0], outs
  # Longest first at --jobs=2; every line names its point.
  assert outs[0].index("L2d32_6: -m launch.train") < outs[0].index("L2d32_3: -m launch.train")
  assert "] L2d32_6: done in " in outs[0] and "] L2d32_3: done in " in outs[0], outs[0]
  logs = set()
  for name in ("L2d32_3", "L2d32_6"):
    got, want = (ladder.read_record(str(w / name)) for w in (work, ref))
    assert got["status"] == want["status"] == "done" and got["eval_loss"] == want["eval_loss"]
    assert "jobs" not in want and f"--workdir={work / name} " in got["command"] + " "
    curve = lambda w: [(s, m.get("loss")) for s, m in sorted(ladder.read_metrics(str(w)).items())]
    assert curve(work / name) == curve(ref / name) and len(curve(ref / name)) >= 3
    logs.add(got["log"])
  assert len(logs) == 2


def test_bad_jobs_and_jobs_that_do_not_fit_are_one_line_errors(tmp_path, env):
  rc, out = _ladder(env, "--config=configs/ladder.py:micro", f"--workdir={tmp_path / 'w'}",
                    "--jobs=0")
  assert rc == 2 and out.strip() == ("error: --jobs=0: the number of points trained at once "
                                     "must be 1 or more"), out
  with pytest.raises(ladder.LadderError, match="--jobs=-1"):
    ladder.run_ladder("configs/ladder.py:micro", str(tmp_path / "w"), jobs=-1)
  # A width whose memory plan exceeds any host: refused before anything starts.
  big = tmp_path / "big_ladder.py"
  big.write_text(textwrap.dedent("""
      from configs import ladder
      ladder.GRIDS["big"] = dict(ladder.GRIDS["micro"], sizes={"L2d32": (2, 32),
                                                               "L2d8192": (2, 8192)})
      get_config = ladder.get_config
      """))
  rc, out = _ladder(env, f"--config={big}:big", f"--workdir={tmp_path / 'w'}", "--jobs=2")
  assert rc == 2 and len(out.strip().splitlines()) == 1, out
  assert out.startswith("error: --jobs=2 does not fit one cpu device") and "L2d8192_" in out
  assert "not even one run fits; nothing was run" in out
  assert not (tmp_path / "w").exists()


def test_gpu_share_memory_check_and_order():
  """On a GPU every run gets 0.9/jobs of the memory (a value set by the user is kept); the check
  fits the largest plan into that share and the jobs largest into the device; TPUs take one
  process; the order is the most compute first, ties in plan order."""
  gib = 2.0 ** 30
  gpu = ladder_jobs.Device("gpu", 1, 139 * gib)
  env = {"XLA_FLAGS": "--x"}
  assert ladder_jobs.child_env(env, gpu, 1) is env
  assert ladder_jobs.child_env(env, ladder_jobs.Device("cpu", 1, 8 * gib), 4) is env
  assert ladder_jobs.child_env(env, gpu, 4) == {
      "XLA_FLAGS": "--x", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
      "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.225"}
  mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
  assert ladder_jobs.child_env(mine, gpu, 4) == mine

  need = {"L16d512_800": 16.6 * gib, "L8d256_800": 7.7 * gib}
  ladder_jobs.check_fit(need, 7, gpu, {})            # 0.9 / 7 · 139 = 17.9 GiB each
  with pytest.raises(ladder.LadderError, match=r"L16d512_800 needs 16\.6 GiB, more than the 15\.6 "
                     r"GiB each run gets \(XLA_PYTHON_CLIENT_MEM_FRACTION=0\.1125\); at most "
                     r"--jobs=7 fit"):
    ladder_jobs.check_fit(need, 8, gpu, {})
  with pytest.raises(ladder.LadderError, match="not even one run fits"):
    ladder_jobs.check_fit(need, 2, gpu, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"})
  cpu = ladder_jobs.Device("cpu", 1, 20 * gib)       # no share: the jobs largest together
  three = dict(need, small=1 * gib)
  ladder_jobs.check_fit(three, 2, dataclasses.replace(cpu, bytes=25 * gib), {})
  with pytest.raises(ladder.LadderError, match=r"the 3 largest runs need 25\.3 GiB at once \(the "
                     r"largest, L16d512_800: 16\.6 GiB\); at most --jobs=1 fit"):
    ladder_jobs.check_fit(three, 3, cpu, {})
  with pytest.raises(ladder.LadderError, match="a TPU serves one process"):
    ladder_jobs.check_fit(need, 2, ladder_jobs.Device("tpu", 4, 16 * gib), {})

  spec = ladder_cfg.get_config("gpu")
  points = ladder.plan(spec, False)
  described = ladder.validate(os.path.join(REPO, "configs", "ladder.py"), points)
  order = [p.name for p in ladder_jobs.longest_first(points, described)]
  assert order == ["L16d512_800", "L16d512_400", "L12d384_800", "L16d512_200", "L12d384_400",
                   "L8d256_800", "L12d384_200", "L8d256_400", "L8d256_200"]
  same = {p.name: dict(compute=1.0) for p in points}
  assert ladder_jobs.longest_first(points, same) == points
  twice = points[:2] + points[:1]
  with pytest.raises(ladder.LadderError, match="points share a work directory: L8d256_200"):
    ladder_jobs.run(twice, {}, {}, "gpu", "/nonexistent", {}, print, 2)


# --- ablation switches ----------------------------------------------------------------------------

def _micro_fields(**changes) -> dict:
  spec = ladder.load_config_file(TINY, "micro")
  fields = dict(spec.model)
  fields.update(changes)
  return fields


def _cfg(fields):
  return model_config(base_config(model=fields))


def _batch(cfg, tokens):
  """One document per row, the model's keys as training makes them (`dsv41_jax.testing`)."""
  batch = model_inputs(testing.make_batch(cfg, tokens, np.ones_like(tokens)))
  return jax.tree.map(jnp.asarray, batch)


def _embedding_grad(cfg, t):
  """|d logits[0, t] / d embeddings[0, j]| summed over the width, for every j: [T]."""
  graphdef, state = nnx.split(M.Transformer(cfg, nnx.Rngs(0)))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, cfg.seq_len))
  batch = _batch(cfg, tokens)
  bias = M.zero_moe_bias(cfg)
  h = nnx.merge(graphdef, state).embed_tokens(batch["tokens"])

  def out(h):
    return nnx.merge(graphdef, state)(batch, bias, input_embeddings_BxTxD=h)[0][0, t].sum()

  return np.abs(np.asarray(jax.jit(jax.grad(out))(h)))[0].sum(-1)


def test_dense_attention_sees_every_earlier_token():
  fields = _micro_fields()
  ladder_cfg.ablate(fields, "dense_attention")
  cfg = _cfg(fields)
  assert all(l.mode == "swa" for l in build_layer_plan(cfg)) and cfg.sliding_window == cfg.seq_len
  t = cfg.seq_len - 1
  g = _embedding_grad(cfg, t)
  assert np.all(g[:t + 1] > 0)
  t = cfg.seq_len // 2  # and nothing later is seen
  g = _embedding_grad(cfg, t)
  assert np.all(g[:t + 1] > 0) and np.all(g[t + 1:] == 0)


def test_full_depth_kv_and_candidate_pool_and_engram_off_change_the_plan():
  def plan(ablation=None):
    return build_layer_plan(model_config(ladder_cfg.point_config("cpu", "L10d32", 10, ablation)))

  base, full = plan(), plan("full_depth_kv")
  n = len(base)
  # CED: decoder layers 5..9 read layer 5's KV (Reuse / Reindex); without it each is a Full layer.
  assert {base[i].kv_source for i in range(n // 2, n)} == {n // 2}
  assert any(base[i].mode in ("reuse", "reindex") for i in range(n // 2, n))
  assert all(full[i].mode == "full" and full[i].kv_source == i for i in range(n // 2, n))
  assert [l.mode for l in full][:n // 2] == [l.mode for l in base][:n // 2]

  pool = plan("candidate_pool")
  assert all(l.candidate_role is None for l in base)
  roles = {l.index: l.candidate_role for l in pool if l.candidate_role}
  assert roles == {5: "source", 9: "consumer"}

  no_engram = plan("engram_off")
  assert any(l.engram for l in base) and not any(l.engram for l in no_engram)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      M.abstract_params(model_config(ladder_cfg.point_config("cpu", "L10d32", 10, "engram_off"))))]
  assert paths and not any("engram" in p for p in paths)


def test_plain_residual_has_no_mhc_parameters():
  """The arm is `residual="plain"` (tests/dsv41_jax/test_residual.py: X ← X + F(norm(X)), exactly):
  no mHC site in the parameter tree, nothing frozen, and an optimizer for it builds."""
  from launch.step import engram_sub_tables
  from optim.chain import build_optimizer
  from optim.config import optim_config
  from optim.table import flatten_params

  base = ladder_cfg.point_config("micro", "L2d32", 3)
  arm = ladder_cfg.point_config("micro", "L2d32", 3, "plain_residual")
  cfg = model_config(arm)
  assert cfg.residual == "plain" and cfg.hc_mult == 1 and tuple(arm.optim.frozen) == ()
  paths = lambda c: [p for p, _ in flatten_params(M.abstract_params(c))]
  assert any("_hc/" in p for p in paths(model_config(base)))
  assert paths(cfg) and not any("_hc" in p for p in paths(cfg))
  model = M.abstract_model(cfg)
  build_optimizer(optim_config(arm.optim), nnx.state(model, nnx.Param),
                  sub_tables=engram_sub_tables(model))


def test_qat_changes_the_logits_of_the_same_parameters():
  fields = _micro_fields(head_dim=32, index_head_dim=32)  # the FP4 / FP8 blocks need 32
  base = _cfg(fields)
  ladder_cfg.ablate(fields, "qat")
  qat = _cfg(fields)
  assert qat.fp4_main_kv and qat.fp4_indexer and qat.fp8_swa_kv
  graphdef, state = nnx.split(M.Transformer(base, nnx.Rngs(0)))
  tokens = np.random.default_rng(1).integers(0, base.vocab_size, (2, base.seq_len))
  bias = M.zero_moe_bias(base)
  out = {}
  for name, cfg in (("base", base), ("qat", qat)):
    g, _ = nnx.split(M.abstract_model(cfg))
    out[name] = np.asarray(jax.jit(lambda s, b, g=g: nnx.merge(g, s)(b, bias)[0])(
        state, _batch(cfg, tokens)))
  assert np.isfinite(out["qat"]).all()
  assert np.abs(out["qat"] - out["base"]).max() > 1e-4


def test_adamw_ablation_changes_the_optimizer_chain_only():
  from optim.config import optim_config
  base = ladder_cfg.point_config("micro", "L2d32", 3)
  arm = ladder_cfg.point_config("micro", "L2d32", 3, "adamw")
  assert optim_config(base.optim).chain == "muon" and optim_config(arm.optim).chain == "adamw"
  assert model_config(arm) == model_config(base)
  assert dict(arm.optim, chain="muon") == dict(base.optim)
  assert "adamw" in ladder_cfg.ABLATIONS


def test_bf16_streams_ablation_changes_the_streams_dtype_only():
  base = ladder_cfg.point_config("micro", "L2d32", 3)
  arm = ladder_cfg.point_config("micro", "L2d32", 3, "bf16_streams")
  assert model_config(arm).hc_stream_dtype == "bfloat16"
  assert model_config(arm) == dataclasses.replace(model_config(base), hc_stream_dtype="bfloat16")
  assert dict(arm.optim) == dict(base.optim)
