"""Scaling ladders and ablations (issue 17): grids of ordinary `launch.train` runs, a table, fits, plots.

  python -m launch.ladder --config=configs/ladder.py:cpu --workdir=DIR               # the grid
  python -m launch.ladder --config=configs/ladder.py:cpu --workdir=DIR --ablations   # ablations
  python -m launch.ladder --config=configs/ladder.py:cpu --workdir=DIR --list        # commands
  python -m launch.ladder --config=configs/ladder.py:micro --workdir=DIR             # <1 min
  python -m launch.ladder --config=configs/ladder.py:gpu --workdir=DIR --sweep       # lr sweeps
  python -m launch.ladder --config=configs/ladder.py:gpu --workdir=DIR --jobs=4      # 4 at once
  python -m launch.ladder --config=configs/ladder.py:gpu --workdir=DIR --only='L16d512_800'
  python -m launch.ladder --report DIR [--out=OUT]                                   # table, fits, plots

A ladder config file (`configs/ladder.py`) answers a grid name with the grid's spec (`sizes`,
`steps`, `ablation_size`, `ablation_steps`, `ablations`, `seeds`) and a point argument
`<grid>/<size>/<steps>[/<ablation>]` with that run's `launch.train` config. Each point runs as

  python -m launch.train --config=<file>:<point> --workdir=DIR/<name> --config.train.seed=<seed>

with its output in DIR/<name>/train.log and its record in DIR/<name>/point.json (with the chain and
peak learning rate its config gives, and `lr_note` where the grid's rate at its size is untuned:
`configs/ladder.py` `peak_lr`); `--list` prints
each point's command as a shell line to paste (`cd <repo> && XLA_FLAGS=... <this python> -m
launch.train ...`: the directory, environment and interpreter the ladder runs it with; a `#` line
before it where the point's directory holds a stale run, which the pasted line would resume). A point is done
when the run exited 0 with a held-out loss at its last step; a done point is never rerun, any other
is (re)started, and `launch.train` resumes it from its last checkpoint. A done point whose run
trained at another chain or peak rate than its config now gives (a grid whose rates were retuned)
is stale (every point of the plan is checked, whether `--only` selects it or not): marked "stale:
ran at lr 2e-3, config says 8e-3" (left out of the fits, results kept) and, when it runs, moved to
DIR/stale/ and trained afresh (`ladder_jobs`, "Stale runs"). Every point's config is
built and validated (ModelConfig, OptimConfig, schedule) before the first run; an invalid one
stops the ladder with every error listed (exit status 2). A run that fails is recorded as failed
with its log path and the ladder moves on; the report fits the points that finished. Ctrl-C,
SIGINT or SIGTERM stops the running points (each saves a checkpoint), records them as
interrupted and exits 130; the same command again resumes them.

`--only=PATTERN[,PATTERN...]` runs (or lists) only the points whose names match one of the shell
patterns (`L16d512_*`, `sweeps/muon_*`); a pattern that matches no point is an error (exit 2)
listing the names. It is how a budget of separate device calls is spent: a point's checkpoints
stay on the machine that trained it, so each call should run points it can finish.

`--time_limit=SECONDS` (a device lease, a batch job's wall clock): the ladder does not start a
point that would not finish within SECONDS of its start, timed from the finished points of its
size in DIR (`launch.ladder_jobs`: median seconds a step × steps + the median time outside the
steps; a point with none is started), and goes on to the next one that fits; at the limit it
stops the running points as on SIGTERM (each saves a checkpoint, recorded interrupted). Either
way it writes the report and exits 75 (EX_TEMPFAIL: the same command again goes on); 0 when every
point is done. Give a surrounding `timeout` ~30 s more for the last checkpoint.

`--jobs=N` (default 1: one point after another, in plan order) trains up to N points at once on
one machine, each its own `launch.train` process and work directory, the most compute first; on
a GPU each process allocates on demand up to 0.9/N of the memory, and the ladder exits 2 before
running anything when N runs would not fit by the analytic memory plan (`launch/ladder_jobs.py`:
order, memory, signals). Points are small enough (0.5-1.4 % MFU on one H200) that their
start-up and compilation, on the host's cores, overlap the others' steps.

Per point: N = activated matrix parameters per token (`dsv41_jax.flops.active_matrix_params`,
embedding look-ups excluded, head included), D = steps × batch × seq tokens, and
C = `dsv41_jax.flops.train_flops_per_token` (at data.seq_len) × D, the formula behind MFU.
Held-out loss and bits per byte are `launch.train`'s last `eval/loss`, `eval/bits_per_byte`
(`launch/evaluation.py`). Peak lr: the rate the run trained at (`ladder_jobs.ran_at`; ° read from
the schedule it logged, † an untuned rate). Fits: `launch/scaling_fit.py`. Ablation points train
the grid's ablation size with one switch each (`configs/ladder.py` `ablate`), the same data order
(data.seed fixed) and the same token budget, once per seed (`train.seed`, the initialisation); the
table gives each switch's held-out loss minus the baseline's at the same seed. `--sweep` runs
the grid's learning-rate sweeps of the optimizer chains instead (`launch/sweep.py`: stages, report).
"""

from __future__ import annotations

import csv
import dataclasses
import fnmatch
import functools
import importlib.util
import json
import math
import os
import shlex
import signal
import sys
import time
from typing import Any

import numpy as np
from absl import app, flags

from launch import cli, ladder_jobs, scaling_fit, sweep
from launch.ladder_jobs import LadderError, final_eval, read_metrics, read_record

_CONFIG = _WORKDIR = _ABLATIONS = _SWEEP = _LIST = _REPORT = _OUT = _JOBS = _ONLY = None


def _define_flags() -> None:
  """The command's flags, defined only when it runs as a program: tests import this module beside
  `launch.train`, whose `--config` / `--workdir` flags would otherwise collide."""
  global _CONFIG, _WORKDIR, _ABLATIONS, _SWEEP, _LIST, _REPORT, _OUT, _JOBS, _ONLY, _TIME_LIMIT
  _CONFIG = flags.DEFINE_string("config", None, "Ladder config: <file>:<grid>, e.g. "
                                "configs/ladder.py:cpu.")
  _WORKDIR = flags.DEFINE_string("workdir", None, "Ladder directory: one sub-directory per point.")
  _ABLATIONS = flags.DEFINE_bool("ablations", False, "Run the ablations (DIR/ablations/...) "
                                 "instead of the grid.")
  _SWEEP = flags.DEFINE_bool("sweep", False, "Run the grid's learning-rate sweeps of the optimizer "
                             "chains (DIR/sweeps/...) instead of the grid.")
  _LIST = flags.DEFINE_bool("list", False, "Print each point's launch.train command; run nothing.")
  _REPORT = flags.DEFINE_string("report", None, "Redo table, fits and plots from the finished "
                                "runs in this ladder directory; run nothing.")
  _OUT = flags.DEFINE_string("out", None, "Where the report goes (default: the ladder directory).")
  _JOBS = flags.DEFINE_integer("jobs", 1, "Points trained at once, each its own launch.train "
                               "process (on a GPU each with 0.9/jobs of its memory); 1: one by "
                               "one.")
  _TIME_LIMIT = flags.DEFINE_float("time_limit", None, "Seconds the ladder may run: a point "
                                   "that would not finish in time is not started; at the limit "
                                   "the running points are stopped (resumable); exit 75.")
  _ONLY = flags.DEFINE_list("only", None, "Only the points whose names match one of these shell "
                            "patterns (e.g. L16d512_*,L8d256_200).")


REPO = ladder_jobs.REPO
EX_TEMPFAIL = 75   # the exit status when a time limit left points to run (sysexits.h)


@dataclasses.dataclass(frozen=True)
class Point:
  name: str              # sub-directory under the ladder directory
  arg: str               # the config file's point argument
  seed: int
  kind: str              # "grid", "ablation" or "sweep"
  size: str
  steps: int
  ablation: str = ""     # "" = the baseline (ablation points) or a grid point; a sweep's arm
  chain: str = ""        # sweep points: the optimizer chain and its peak learning rate
  lr: float = 0.0


def load_config_file(path: str, arg: str | None):
  """`get_config(arg)` of a config file given by path (the module is loaded afresh)."""
  spec = importlib.util.spec_from_file_location(f"_ladder_cfg_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def split_config(config: str) -> tuple[str, str]:
  path, _, grid = config.partition(":")
  return os.path.abspath(path), grid


def plan(spec, ablations: bool, sweeps: bool = False, records=()) -> list[Point]:
  """The points of a grid spec: every size × budget, cheapest budget first across the sizes (a
  ladder stopped early still spans the sizes), or the ablations at the ablation size, each switch
  over every seed before the next switch (a partial run still has every seed of its switches),
  or the sweeps (`sweep.stage_one`, then `sweep.stage_two` of the finished `records`)."""
  grid = spec.grid
  if sweeps:
    if not spec.get("sweep"):
      raise LadderError(f"grid {grid!r} has no sweep spec (configs/ladder.py GRIDS[...]['sweep'])")
    return sweep.stage_one(spec, Point) + sweep.stage_two(spec, Point, list(records))
  if not ablations:
    return [Point(f"{size}_{steps}", f"{grid}/{size}/{steps}", 0, "grid", size, steps)
            for steps in spec.steps for size in spec.sizes]
  size, steps = spec.ablation_size, spec.ablation_steps
  out = []
  for ab in ("",) + tuple(spec.ablations):
    for seed in spec.seeds:
      arg = f"{grid}/{size}/{steps}/{ab or 'baseline'}"
      out.append(Point(f"ablations/{ab or 'baseline'}_seed{seed}", arg, seed, "ablation", size,
                       steps, ab))
  return out


def select(points: list[Point], patterns, more: list[Point] = ()) -> list[Point]:
  """The points whose names match one of the shell `patterns` (all when None). Each pattern must
  match a point of `points` or of `more` (the points a later stage may add: a sweep's second
  stage), else LadderError listing the names."""
  if patterns is None:
    return list(points)
  names = [p.name for p in list(points) + list(more)]
  unmatched = [pat for pat in patterns if not fnmatch.filter(names, pat)]
  if unmatched:
    raise LadderError(f"--only {','.join(unmatched)}: matches no point; the points are: "
                      + ", ".join(names))
  return [p for p in points if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]


def later_points(spec, first: list[Point], sweeps: bool) -> list[Point]:
  """The names a sweep's second stage may add (each first-stage arm at every seed), so that
  `--only` may name them before the first stage has chosen its best rates."""
  if not sweeps:
    return []
  seeds = spec.sweep.seeds
  return [dataclasses.replace(p, name=p.name[:-len(f"_seed{p.seed}")] + f"_seed{s}", seed=s)
          for p in first for s in seeds[1:]]


def describe(path: str, point: Point) -> dict[str, Any]:
  """Build and validate a point's config; its size and compute figures (see the docstring)."""
  from configs.common import model_config
  from dsv41_jax import flops
  from optim.config import optim_config
  from optim.schedule import boundaries

  cfg = load_config_file(path, point.arg)
  mcfg = model_config(cfg)
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  boundaries(optim_config({**dict(cfg.optim), "tokens_per_step": tokens_per_step}))
  tokens = cfg.train.steps * tokens_per_step
  fpt = flops.train_flops_per_token(mcfg.replace(seq_len=cfg.data.seq_len))
  return dict(layers=mcfg.num_hidden_layers, d=mcfg.hidden_size,
              n_active=flops.active_matrix_params(mcfg), flops_per_token=fpt,
              tokens=tokens, compute=fpt * tokens, **trained_as(cfg))


def trained_as(cfg) -> dict[str, Any]:
  """The optimizer chain and peak learning rate of a point's config (what `ladder_jobs.reconcile`
  holds a record's run to)."""
  return dict(chain=cfg.optim.get("chain", "muon"), lr=float(cfg.optim.lr))


def command(path: str, point: Point, workdir: str) -> list[str]:
  return [sys.executable, "-m", "launch.train", f"--config={path}:{point.arg}",
          f"--workdir={os.path.join(workdir, point.name)}", f"--config.train.seed={point.seed}"]


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
  """`cmd` as the ladder runs it, pasteable into a shell: from the repository, with XLA_FLAGS."""
  flags_ = env.get("XLA_FLAGS", "")
  prefix = f"XLA_FLAGS={shlex.quote(flags_)} " if flags_ else ""
  return f"cd {shlex.quote(REPO)} && {prefix}{shlex.join(cmd)}"


def validate(path: str, points: list[Point]) -> dict[str, dict[str, Any]]:
  """Every point's `describe`; raises LadderError listing every invalid point."""
  described, errors = {}, []
  for p in points:
    try:
      described[p.name] = describe(path, p)
    except Exception as e:  # noqa: BLE001 - any config error is reported with its point
      errors.append(f"  {p.name} ({os.path.relpath(path, REPO)}:{p.arg}): "
                    f"{type(e).__name__}: {e}")
  if errors:
    raise LadderError(f"{len(errors)} of {len(points)} ladder points have an invalid config; "
                      "nothing was run:\n" + "\n".join(errors))
  return described


def point_env(spec) -> dict[str, str]:
  """The runs' environment: this one, with the grid's `xla_flags` appended to XLA_FLAGS."""
  env = dict(os.environ)
  if spec.get("xla_flags"):
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), spec.xla_flags]).strip()
  return env


def run_ladder(config: str, workdir: str, ablations: bool = False, log=print,
               sweeps: bool = False, jobs: int = 1, only=None,
               time_limit: float | None = None) -> list[dict]:
  """Run every point not yet done (of those `only` selects, see `select`), `jobs` at a time
  (`launch.ladder_jobs`), within `time_limit` seconds if given (`ladder_jobs.TimeLimit` when it
  stops running points); returns the records. Sweeps run in two stages: the second (the best
  rates at more seeds) is planned from the first's results."""
  deadline = None
  if time_limit is not None:
    if not time_limit > 0:
      raise LadderError(f"--time_limit={time_limit}: give the seconds the ladder may run, > 0")
    deadline = time.time() + time_limit
  ladder_jobs.check_jobs(jobs)
  path, grid = split_config(config)
  spec = load_config_file(path, grid)
  env = point_env(spec)
  device = functools.cache(lambda: ladder_jobs.probe_device(env))
  first = plan(spec, ablations, sweeps)
  chosen = select(first, only, later_points(spec, first, sweeps))
  for p in first:   # the points --only leaves out: a stale one is marked, not left to be fitted
    pdir = os.path.join(workdir, p.name)
    if p not in chosen and read_record(pdir) is not None:
      _, why = ladder_jobs.reconcile(pdir, trained_as(load_config_file(path, p.arg)))
      if why:
        log(f"{p.name}: {why}; not selected, left out of the fits until it runs")
  records = _run_points(path, spec, chosen, workdir, env, log, jobs, device, deadline)
  if sweeps:
    ran = {r["name"] for r in records}
    more = [p for p in plan(spec, False, True, finished_first(first, records, workdir))
            if p.name not in ran]
    records += _run_points(path, spec, select(more, only, first + later_points(spec, first, True)),
                           workdir, env, log, jobs, device, deadline)
  return records


def finished_first(first: list[Point], records: list[dict], workdir: str) -> list[dict]:
  """The records of every first-stage point that is done: this call's, and those an earlier call
  left in `workdir` (a call that `--only` runs the second stage plans it from all of them)."""
  out = {r["name"]: r for r in records}
  for p in first:
    if p.name not in out:
      old = ladder_jobs.read_record(os.path.join(workdir, p.name))
      if old is not None:
        out[p.name] = old
  return [r for r in out.values() if r.get("status") == "done"]


def _run_points(path: str, spec, points: list[Point], workdir: str, env: dict[str, str], log,
                jobs: int = 1, device=None, deadline: float | None = None) -> list[dict]:
  """Validate `points`, then run them (`ladder_jobs.run`); with jobs > 1 first the memory check
  against `device()` and the longest first (the `ladder_jobs` docstring)."""
  described = validate(path, points)
  for p in points:   # the grid's rate at an unswept size is a guess, and its record says so
    note = spec.get("untuned", {}).get(p.size, "")
    described[p.name]["lr_note"] = "" if p.kind == "sweep" else note
  if jobs > 1:
    dev = device()
    ladder_jobs.check_fit(memory_need(path, points, dev.count, dev.platform), jobs, dev, env)
    env = ladder_jobs.child_env(env, dev, jobs)
    points = ladder_jobs.longest_first(points, described)
  commands = {p.name: command(path, p, workdir) for p in points}
  return ladder_jobs.run(points, commands, described, spec.grid, workdir, env, log, jobs,
                         deadline)


def memory_need(path: str, points: list[Point], devices: int, platform: str) -> dict[str, float]:
  """Point name -> bytes per device of its train step by the analytic memory plan
  (`launch.memory_plan.analytic_plan` on the config's mesh over `devices`, the config's batch,
  for the runs' `platform`: this process never starts a backend of its own on their devices);
  a point whose mesh does not fit the devices is left out (its run fails and is recorded)."""
  from configs.common import model_config
  from launch import memory_plan

  out, plans = {}, {}
  for p in points:
    cfg = load_config_file(path, p.arg)
    try:
      sizes = memory_plan.resolve_mesh(dict(cfg.mesh), devices)
      key = (model_config(cfg), tuple(sizes.items()), cfg.data.batch_size, cfg.data.seq_len,
             cfg.optim.get("chain", "muon"), cfg.train.get("grad_accum_steps", 1))
      if key not in plans:
        plans[key] = memory_plan.analytic_plan(key[0], sizes, *key[2:4], None, *key[4:],
                                               backend=platform)
    except memory_plan.PlanError:
      continue
    out[p.name] = plans[key]["total_bytes"]
  return out


# --- report ---------------------------------------------------------------------------------------

COLUMNS = ("name", "kind", "size", "layers", "d", "steps", "seed", "ablation", "chain", "lr",
           "lr_from", "lr_note", "n_active",
           "flops_per_token", "tokens", "compute", "eval_loss", "eval_bpb", "train_loss",
           "text_epochs", "seconds", "status", "log", "command")


def collect(ladder_dir: str) -> list[dict[str, Any]]:
  """One row per point directory (grid and ablations), with its training-loss curve."""
  rows = []
  for sub in ("", "ablations", "sweeps"):
    base = os.path.join(ladder_dir, sub)
    if not os.path.isdir(base):
      continue
    for name in sorted(os.listdir(base)):
      pdir = os.path.join(base, name)
      rec = read_record(pdir) if os.path.isdir(pdir) else None
      if rec is None:
        continue
      metrics = read_metrics(pdir)
      curve = sorted((s, m["loss"]) for s, m in metrics.items() if m.get("loss") is not None)
      ev = final_eval(pdir, rec["steps"]) if rec.get("status") == "done" else None
      row = dict(rec, **(ev or {}))
      chain, lr, lr_from = ladder_jobs.ran_at(rec, pdir)
      row.update(chain=chain or "", lr=lr, lr_from=lr_from, lr_note=rec.get("lr_note", ""))
      row["train_loss"] = curve[-1][1] if curve else None
      passes = [m["data/epochs/text"] for _, m in sorted(metrics.items())
                if m.get("data/epochs/text") is not None]
      row["text_epochs"] = passes[-1] if passes else None   # None: a run from before the count
      row["curve"] = curve
      row["eval_curve"] = sweep.eval_curve(metrics, rec["tokens"] / rec["steps"])
      rows.append(row)
  return rows


def fits(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """Frontier fit L(C) and grid fit L(N, D) over the finished grid points (see scaling_fit)."""
  done = [r for r in rows if r["kind"] == "grid" and r["status"] == "done"]
  out: dict[str, Any] = {"points_fitted": [r["name"] for r in done],
                         "peak_lrs": peak_lrs(done)}
  if not done:
    return out
  C = np.array([r["compute"] for r in done])
  L = np.array([r["eval_loss"] for r in done])
  idx = scaling_fit.frontier(C, L)
  out["frontier"] = [done[i]["name"] for i in idx]
  try:
    f = scaling_fit.fit_power_law(C[idx], L[idx])
    out["frontier_fit"] = dict(f.to_dict(), points=out["frontier"])
  except ValueError as e:
    out["frontier_fit"] = {"error": str(e)}
  try:
    N = np.array([r["n_active"] for r in done])
    D = np.array([r["tokens"] for r in done])
    g = scaling_fit.fit_chinchilla(N, D, L)
    out["grid_fit"] = dict(g.to_dict(), points=out["points_fitted"])
  except ValueError as e:
    out["grid_fit"] = {"error": str(e)}
  return out


def peak_lrs(rows: list[dict[str, Any]]) -> dict[str, list[float | None]]:
  """Size -> the distinct peak rates its rows trained at (more than one: the rows mix rates)."""
  out: dict[str, list[float | None]] = {}
  for r in rows:
    lrs = out.setdefault(r["size"], [])
    if r.get("lr") not in lrs:
      lrs.append(r.get("lr"))
  return out


def lr_cell(r: dict[str, Any]) -> str:
  """A row's peak rate as the report prints it: ° read from its logged schedule, † untuned."""
  return (ladder_jobs.format_lr(r.get("lr")) + ("°" if r.get("lr_from") == "metrics.jsonl" else "")
          + ("†" if r.get("lr_note") else ""))


def ablation_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per switch: held-out loss (and bpb) minus the baseline's at the same seed, over seeds."""
  abl = [r for r in rows if r["kind"] == "ablation" and r["status"] == "done"]
  base = {r["seed"]: r for r in abl if not r["ablation"]}
  spread = float(np.ptp([b["eval_loss"] for b in base.values()])) if base else 0.0
  out = []
  for name in sorted({r["ablation"] for r in abl if r["ablation"]}):
    pairs = [(r, base[r["seed"]]) for r in abl if r["ablation"] == name and r["seed"] in base]
    if not pairs:
      continue
    dl = np.array([r["eval_loss"] - b["eval_loss"] for r, b in pairs])
    db = np.array([r["eval_bpb"] - b["eval_bpb"] for r, b in pairs])
    out.append(dict(
        ablation=name, seeds=[r["seed"] for r, _ in pairs],
        eval_loss=[r["eval_loss"] for r, _ in pairs],
        baseline_loss=[b["eval_loss"] for _, b in pairs],
        delta_loss_mean=float(dl.mean()), delta_loss_min=float(dl.min()),
        delta_loss_max=float(dl.max()),
        delta_loss_std=float(dl.std(ddof=1)) if len(dl) > 1 else None,
        delta_bpb_mean=float(db.mean()),
        flops_ratio=pairs[0][0]["flops_per_token"] / pairs[0][1]["flops_per_token"],
        lr=", ".join(dict.fromkeys(lr_cell(r) for r, _ in pairs)),
        baseline_lr=", ".join(dict.fromkeys(lr_cell(b) for b in base.values())),
        baseline_spread=spread, baseline_seeds=sorted(base),
        verdict=ablation_verdict(dl, spread, len(base))))
  return out


def ablation_verdict(deltas, baseline_spread: float, baseline_seeds: int) -> str:
  """Whether a switch's effect is told apart from seed noise: "beyond the seed spread" when every
  seed's Δ has the same sign and the smallest |Δ| exceeds the baseline's spread over seeds,
  "within noise" when not, and "one baseline seed: no spread yet" while the baseline has one seed
  (its spread of 0 would call every effect real). A switch run at one seed so far gets its verdict
  marked provisional: a second seed can flip the sign or fall under the spread."""
  if baseline_seeds < 2:
    return "one baseline seed: no spread yet"
  deltas = np.asarray(deltas)
  same_sign = bool(np.all(deltas > 0) or np.all(deltas < 0))
  verdict = ("beyond the seed spread" if same_sign and np.abs(deltas).min() > baseline_spread
             else "within noise")
  return verdict + (" (one seed so far)" if deltas.size < 2 else "")


def markdown(rows, fit, abl) -> str:
  """The report as markdown tables (what RESULTS.md quotes)."""
  lines = ["| point | peak lr | N active | D tokens | C FLOP | held-out loss | bits/byte | "
           "train loss | text epochs | status |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  def num(r, key, fmt):
    return format(r[key], fmt) if r.get(key) is not None else "-"
  repeated = False
  for r in rows:
    if r["kind"] != "grid":
      continue
    status = r["status"] if r["status"] == "done" else f"{r['status']} ({r['log']})"
    mark = " *" if r["name"] in fit.get("frontier", ()) else ""
    over = (r.get("text_epochs") or 0) > 1
    repeated |= over
    lines.append(f"| {r['name']}{mark} | {lr_cell(r)} | {r['n_active']:.3g} | {r['tokens']:.3g} | "
                 f"{r['compute']:.3g} | {num(r, 'eval_loss', '.4f')} | {num(r, 'eval_bpb', '.4f')} | "
                 f"{num(r, 'train_loss', '.4f')} | {num(r, 'text_epochs', '.2f')}{' !' if over else ''}"
                 f" | {status} |")
  if repeated:
    lines += ["", "! read its training text more than once (data/epochs/text > 1): its held-out loss "
              "mixes scaling with repetition of the same documents."]
  lines += lr_notes([r for r in rows if r["kind"] in ("grid", "ablation")])
  if fit.get("peak_lrs"):
    per_size = {s: " and ".join(map(ladder_jobs.format_lr, lrs))
                for s, lrs in fit["peak_lrs"].items()}
    mixed = [s for s, lrs in fit["peak_lrs"].items() if len(lrs) > 1]
    lines.append("\npeak lr of the fitted points: " + ", ".join(f"{s} {v}" for s, v in
                                                                per_size.items())
                 + (f" (warning: mixed rates at {', '.join(mixed)}: the fits mix them)"
                    if mixed else ""))
  for key in ("frontier_fit", "grid_fit"):
    f = fit.get(key)
    if not f:
      continue
    if "error" in f:
      lines.append(f"\n{key}: {f['error']}")
      continue
    params = ", ".join(f"{k} = {v:.4g}" for k, v in f["params"].items())
    res = ", ".join(f"{v:+.4f}" for v in f["residuals"])
    lines.append(f"\n{key}: {f['law']}; {params}; R² = {f['r2']:.4f} over {f['n_points']} "
                 f"points; residuals {res}")
  if abl:
    lines += ["", "| switch | peak lr | Δ held-out loss (mean) | min … max over seeds | seeds | "
              "FLOP/token × | against the seed spread |", "|---|---:|---:|---:|---|---:|---|"]
    for a in abl:
      lines.append(f"| {a['ablation']} | {a['lr']} | {a['delta_loss_mean']:+.4f} | "
                   f"{a['delta_loss_min']:+.4f} … {a['delta_loss_max']:+.4f} | "
                   f"{','.join(map(str, a['seeds']))} | {a['flops_ratio']:.3f} | {a['verdict']} |")
    seeds = abl[0]["baseline_seeds"]
    lines.append(f"\nbaseline held-out loss spread over seeds {','.join(map(str, seeds))}: "
                 + (f"{abl[0]['baseline_spread']:.4f}" if len(seeds) > 1 else "none yet (one seed)")
                 + f"; baseline peak lr {abl[0]['baseline_lr']}")
  left = [r for r in rows if r["kind"] == "ablation" and r["status"] != "done"]
  if left:
    lines.append("\nablation points not in the table: "
                 + "; ".join(f"{r['name']} ({r['status']})" for r in left))
  return "\n".join(lines) + "\n"


def lr_notes(rows: list[dict[str, Any]]) -> list[str]:
  """The footnotes of `lr_cell`'s marks among `rows`."""
  out = []
  if any(r.get("lr_from") == "metrics.jsonl" for r in rows):
    out.append("° peak lr read from the schedule the run logged (metrics.jsonl `lr/muon`): its "
               "record predates the ladder's `lr` field")
  notes = {r["size"]: r["lr_note"] for r in rows if r.get("lr_note")}
  out += [f"† {size}: {note}" for size, note in notes.items()]
  return [""] + out if out else []


def plots(rows, fit, out_dir: str) -> list[str]:
  """loss_curves.png, frontier.png, residuals.png and, with sweep points, sweep.png (held-out
  loss against the peak learning rate per size and chain); matplotlib, an optional dependency."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed (pip install -e '.[ladder]'): no plots", file=sys.stderr)
    return []
  grid = [r for r in rows if r["kind"] == "grid" and r["curve"]]
  sizes = sorted({r["size"] for r in grid}, key=lambda s: min(r["n_active"] for r in grid
                                                              if r["size"] == s))
  colours = {s: plt.cm.viridis(i / max(1, len(sizes) - 1)) for i, s in enumerate(sizes)}
  written = []

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in grid:
    tps = r["tokens"] / r["steps"]
    s, l = zip(*r["curve"])
    ax.plot(np.array(s) * tps, l, color=colours[r["size"]], lw=1,
            label=f"{r['size']} × {r['steps']}")
    if r.get("eval_loss") is not None:
      ax.plot([r["tokens"]], [r["eval_loss"]], "o", color=colours[r["size"]], ms=4)
  ax.set_xscale("log")
  ax.set_xlabel("tokens")
  ax.set_ylabel("training loss (dots: held-out loss at the end)")
  ax.legend(fontsize=6, ncol=2)
  ax.set_title("loss curves per point")
  written.append(_save(fig, out_dir, "loss_curves.png"))

  done = [r for r in rows if r["kind"] == "grid" and r["status"] == "done"]
  ff = fit.get("frontier_fit", {})
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in done:
    on = r["name"] in fit.get("frontier", ())
    ax.plot(r["compute"], r["eval_loss"], "o" if on else "x", color=colours[r["size"]], ms=6)
    ax.annotate(r["name"], (r["compute"], r["eval_loss"]), fontsize=6)
  if "params" in ff:
    C = np.array([r["compute"] for r in done])
    cs = np.geomspace(C.min() / 1.5, C.max() * 1.5, 100)
    p = ff["params"]
    ax.plot(cs, scaling_fit.predict_power_law(scaling_fit.Fit(ff["law"], p, ff["r2"], (), 0), cs),
            "k--", lw=1, label=f"{p['a']:.3g}·C^-{p['b']:.3f} + {p['c']:.3f} (R² {ff['r2']:.3f})")
    ax.legend(fontsize=7)
  ax.set_xscale("log")
  ax.set_xlabel("training compute C (FLOP)")
  ax.set_ylabel("held-out loss (nats/token)")
  ax.set_title("compute frontier (o: on the frontier)")
  written.append(_save(fig, out_dir, "frontier.png"))

  fig, ax = plt.subplots(figsize=(7, 3.5))
  if "residuals" in ff:
    fc = [next(r for r in done if r["name"] == n)["compute"] for n in ff["points"]]
    ax.plot(fc, ff["residuals"], "o-", label="L(C) on the frontier")
  gf = fit.get("grid_fit", {})
  if "residuals" in gf:
    gc = [next(r for r in done if r["name"] == n)["compute"] for n in gf["points"]]
    ax.plot(gc, gf["residuals"], "s", mfc="none", label="L(N, D) on the grid")
  ax.axhline(0, color="k", lw=0.5)
  ax.set_xscale("log")
  ax.set_xlabel("training compute C (FLOP)")
  ax.set_ylabel("observed − fitted loss")
  if ax.get_legend_handles_labels()[1]:
    ax.legend(fontsize=7)
  ax.set_title("fit residuals")
  written.append(_save(fig, out_dir, "residuals.png"))

  sweeps = [r for r in rows if r["kind"] == "sweep" and r["status"] == "done"
            and r.get("eval_loss") is not None]
  if sweeps:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    marks = {"muon": "o", "adamw": "s"}
    for size in sorted({r["size"] for r in sweeps}):
      for chain in sorted({r["chain"] for r in sweeps if r["size"] == size}):
        pts = sorted((r["lr"], r["eval_loss"], r["seed"]) for r in sweeps
                     if r["size"] == size and r["chain"] == chain)
        first = min(seed for _, _, seed in pts)
        line = [(lr, loss) for lr, loss, seed in pts if seed == first]
        kw = dict(color=colours.get(size, "k"), marker=marks.get(chain, "^"),
                  ls="-" if chain == "muon" else "--")
        ax.plot(*zip(*line), label=f"{size} {chain} (seed {first})", **kw)
        more = [(lr, loss) for lr, loss, seed in pts if seed != first]
        if more:
          ax.plot(*zip(*more), ls="none", mfc="none", color=kw["color"], marker=kw["marker"])
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("held-out loss (open marks: other seeds)")
    ax.legend(fontsize=7)
    ax.set_title("learning-rate sweeps at equal tokens")
    written.append(_save(fig, out_dir, "sweep.png"))
  plt.close("all")
  return written


def _save(fig, out_dir: str, name: str) -> str:
  path = os.path.join(out_dir, name)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def report(ladder_dir: str, out_dir: str | None = None) -> dict[str, Any]:
  """Table (ladder.csv, ladder.json), fits, ablation and sweep tables, plots and report.md in
  `out_dir`."""
  out_dir = out_dir or ladder_dir
  os.makedirs(out_dir, exist_ok=True)
  rows = collect(ladder_dir)
  fit = fits(rows)
  abl = ablation_table(rows)
  sweeps = sweep.sweep_table(rows)
  with open(os.path.join(out_dir, "ladder.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow(r)
  table = [{k: r.get(k) for k in COLUMNS} for r in rows]
  with open(os.path.join(out_dir, "ladder.json"), "w") as f:
    json.dump({"points": table, "fits": fit, "ablations": abl, "sweeps": sweeps,
               "curves": {r["name"]: r["curve"] for r in rows}}, f, indent=1,
              default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)
  text = markdown(rows, fit, abl) + ("\n" + sweep.markdown(sweeps) if sweeps else "")
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write(f"Ladder report of {ladder_dir} (`python -m launch.ladder --report {ladder_dir}`)\n\n")
    f.write(text)
  written = plots(rows, fit, out_dir)
  return {"rows": rows, "fits": fit, "ablations": abl, "sweeps": sweeps, "markdown": text,
          "plots": written}


def main(argv):
  del argv
  try:
    ladder_jobs.check_jobs(_JOBS.value)
    if _REPORT.value:
      r = report(_REPORT.value, _OUT.value)
      print(r["markdown"], end="")
      return
    if not _CONFIG.value or not _WORKDIR.value:
      raise LadderError("--config and --workdir are required (or --report DIR)")
    if _LIST.value:
      path, grid = split_config(_CONFIG.value)
      spec = load_config_file(path, grid)
      first = plan(spec, False, True) if _SWEEP.value else []
      done = [r for r in (read_record(os.path.join(_WORKDIR.value, p.name)) for p in first) if r]
      points = select(plan(spec, _ABLATIONS.value, _SWEEP.value, done), _ONLY.value,
                      later_points(spec, first, _SWEEP.value))
      described = validate(path, points)
      env = point_env(spec)
      for p in points:
        # A stale run in the point's directory (another rate than the config's) would be resumed
        # by the pasted command; the ladder itself moves it aside first (`ladder_jobs.retire`).
        pdir = os.path.join(_WORKDIR.value, p.name)
        rec = read_record(pdir)
        why = ladder_jobs.stale_reason(rec, pdir, described[p.name]) if rec else ""
        if why:
          print(f"# {p.name}: {why}; move {pdir} aside before running this line (the ladder "
                f"moves it to {os.path.join(_WORKDIR.value, 'stale')}/ itself)")
        print(shell_line(command(path, p, _WORKDIR.value), env))
      return
    try:
      records = run_ladder(_CONFIG.value, _WORKDIR.value, _ABLATIONS.value,
                           log=lambda s: print(s, flush=True), sweeps=_SWEEP.value,
                           jobs=_JOBS.value, only=_ONLY.value, time_limit=_TIME_LIMIT.value)
      left = [r["name"] for r in records if r.get("status") == "not started"]
      why = f"{len(left)} point(s) not started in the time left: {', '.join(left)}" if left else ""
    except ladder_jobs.TimeLimit as e:
      why = (f"{_TIME_LIMIT.value:g} s passed: {e} stopped (each saved a checkpoint if it was "
             f"training) and recorded as interrupted")
    r = report(_WORKDIR.value, _OUT.value)
    print(r["markdown"], end="")
    if why:
      print(f"time limit: {why}; run the same command again to go on", file=sys.stderr)
      sys.exit(EX_TEMPFAIL)
  except LadderError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:  # Ctrl-C, SIGINT or SIGTERM (below): the running points saved, stopped
    print("interrupted: the points in progress are stopped (each saving a checkpoint if it was "
          "training) and recorded as interrupted; run the same command again to resume",
          file=sys.stderr)
    sys.exit(130)


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt


if __name__ == "__main__":
  # SIGINT too, explicitly: a process started in the background by a non-interactive shell
  # (`cmd &` in a script, nohup) inherits SIGINT ignored, and Python then installs no
  # KeyboardInterrupt handler, so `timeout -s INT` or a supervisor's SIGINT would not stop the
  # points (launch.train installs its own handlers the same way).
  signal.signal(signal.SIGINT, _raise_interrupt)
  signal.signal(signal.SIGTERM, _raise_interrupt)
  _define_flags()
  app.run(main, flags_parser=cli.parse_flags)
