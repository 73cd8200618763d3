"""Running a ladder's points (issues 17, 29): each an ordinary `launch.train` process, up to
`jobs` of them at once on one machine; `launch.ladder` plans and validates the points, this runs
them and keeps their records.

Records. A point's directory DIR/<name> holds point.json (written atomically: status "running"
when its run starts, then "done", "failed" or "interrupted", with the run's seconds and, when done,
its held-out loss) beside the run's own files; the run's output is appended to its train.log. A
point is done when its run exited 0 with a held-out loss at its last step (`final_eval`).

Stale runs. A record also says which optimizer chain and peak learning rate its run trained with
(`ran_at`: the record's `chain` and `lr`, taken from the point's config when it starts; for a record
older than those, the run's config.json, else the peak of the schedule it logged). A done point
whose run differs from what its config now gives is stale (`reconcile`): its status becomes
"stale: ran at lr 2e-3, config says 8e-3" (kept out of the fits, its results kept) and back to
"done" if the config comes to agree again. Before a point whose earlier run differs (stale, or
stopped part-way at the old rate) starts, that run's directory moves to DIR/stale/<name>.lr<rate>
(`retire`), so the new run starts afresh instead of resuming the old one's checkpoint.

`run` takes the points in the order given: a done point is skipped, any other is started as soon
as fewer than `jobs` runs are going, and `launch.train` resumes it from its last checkpoint. Each
run is recorded when it ends and the ladder goes on; a failed one keeps its exit status and log
path. Ctrl-C, SIGINT (the device's `timeout -s INT`) or SIGTERM to the ladder: every running
process gets SIGTERM (`launch.train` finishes the step in flight, saves a checkpoint and exits),
every running point is recorded as interrupted before the ladder waits for the processes (so a
second signal loses no record), and a run that finished meanwhile is recorded done.

Several at once (`jobs` > 1; the points are small, launch- and compile-bound, so one device trains
several):
  order    the most compute first (`longest_first`: C = FLOP/token × tokens, ties in plan order),
           so the longest run is not the one left alone at the end;
  memory   on a GPU every run gets XLA_PYTHON_CLIENT_PREALLOCATE=false and
           XLA_PYTHON_CLIENT_MEM_FRACTION=0.9/jobs (`child_env`; a value already in the environment
           is kept): each allocates on demand up to its share. On the CPU nothing changes;
  check    before anything starts, `check_fit`: the analytic memory plan of each point
           (`launch.memory_plan.analytic_plan`: parameters, gradients, optimizer state,
           activations, per device; an estimate) must fit its share, and the `jobs` largest
           plans together the device (on the CPU, the host's memory); otherwise one line says how
           many would fit and the ladder exits 2. The device comes from `probe_device`, a short
           process with the runs' environment: the ladder itself never starts a jax backend, which
           on a GPU would hold memory the runs need.
Every run has its own work directory, DIR/<name>; `check_names` refuses a list that repeats one.
Each log line of the ladder names its point: `[k/n] <name>: ...`.

A time limit (`deadline`, `launch.ladder --time_limit`: a device lease, a batch job's wall clock).
A point that would not finish before it is not started: `estimate_seconds` times it from the
finished points of its size (of its sweep chain or ablation where there are such) in the ladder
directory, trained in one run with the same number of runs at once, as their median seconds a
step (metrics.jsonl's `step_time`) times its steps plus their median seconds outside the steps
(start-up, compilation, evaluation, checkpoints), and must fit with a margin for run-to-run
spread (`with_margin`); with several at once and none timed so yet, `jobs` × its time alone; a
point with no finished point of its size is started. The ladder goes on to the next point that
fits. At the deadline the running points are stopped as on SIGTERM (checkpoint, recorded interrupted) and
`TimeLimit` is raised: work that cannot finish on a machine that is then taken away (with its
checkpoints) is not begun, and what was begun stays resumable where the directory survives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
GPU_SHARE = 0.9       # of the device's memory, split evenly over the runs going at once
_POLL_S = 0.5         # how often the ladder looks at its running processes


class LadderError(RuntimeError):
  """The ladder cannot start; the message lists what to change."""


class TimeLimit(RuntimeError):
  """The ladder's deadline came while points were running; they were stopped and recorded as
  interrupted."""


# --- a point's records ----------------------------------------------------------------------------

def read_record(pdir: str) -> dict[str, Any] | None:
  try:
    with open(os.path.join(pdir, "point.json")) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def write_record(pdir: str, record: dict[str, Any]) -> None:
  os.makedirs(pdir, exist_ok=True)
  tmp = os.path.join(pdir, "point.json.tmp")
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, os.path.join(pdir, "point.json"))


def read_metrics(pdir: str) -> dict[int, dict[str, Any]]:
  """metrics.jsonl merged per step (a resumed run appends; the later record wins per key)."""
  out: dict[int, dict[str, Any]] = {}
  try:
    with open(os.path.join(pdir, "metrics.jsonl")) as f:
      for line in f:
        if line.strip():
          r = json.loads(line)
          out.setdefault(int(r["step"]), {}).update(r)
  except FileNotFoundError:
    pass
  return out


def final_eval(pdir: str, steps: int) -> dict[str, float] | None:
  m = read_metrics(pdir).get(steps, {})
  if m.get("eval/loss") is None:
    return None
  return {"eval_loss": m["eval/loss"], "eval_bpb": m.get("eval/bits_per_byte")}


def format_lr(lr: float | None) -> str:
  """A peak rate as the configs write it: 0.002 -> "2e-3", 0.016 -> "1.6e-2"; None -> "?"."""
  if lr is None:
    return "?"
  mantissa, exponent = f"{lr:.3e}".split("e")
  return f"{float(mantissa):g}e{int(exponent)}"


def ran_at(rec: dict[str, Any], pdir: str) -> tuple[str | None, float | None, str | None]:
  """(chain, peak learning rate, where they were read) of a point's run; None where nothing says.

  The record's `chain` and `lr` when set (every record since the ladder took them from the
  point's config; before, a sweep point's only: a grid or ablation point's read "" and 0.0), else
  the run's config.json (`optim.chain`, `optim.lr`), else, for the rate only, the peak of the
  schedule in metrics.jsonl: `lr/muon`, the schedule × `muon_lr_mult`, 1 in every ladder config
  (a done run logs the held rate: its log interval is under its hold)."""
  chain, lr = rec.get("chain") or None, rec.get("lr") or None
  if lr is not None:
    return chain, float(lr), "point.json"
  try:
    with open(os.path.join(pdir, "config.json")) as f:
      optim = json.load(f).get("optim", {})
    return chain or optim.get("chain", "muon"), float(optim["lr"]), "config.json"
  except (FileNotFoundError, KeyError):
    pass
  logged = [m["lr/muon"] for m in read_metrics(pdir).values() if m.get("lr/muon") is not None]
  if logged:
    return chain, float(f"{max(logged):.6g}"), "metrics.jsonl"   # float32 as logged
  return chain, None, None


def stale_reason(rec: dict[str, Any], pdir: str, want: dict[str, Any]) -> str:
  """"" when the run of `rec` trained as `want` (its config's `chain` and `lr`) says, or `want`
  gives no rate; else why not, e.g. "stale: ran at lr 2e-3, config says 8e-3". An unknown rate
  is stale (nothing shows it agrees); an unknown chain (an old grid or ablation record without
  config.json) is not compared."""
  if want.get("lr") is None:
    return ""
  chain, lr, _ = ran_at(rec, pdir)
  same_chain = chain is None or chain == want["chain"]
  if same_chain and lr is not None and math.isclose(lr, want["lr"], rel_tol=1e-5):
    return ""
  if lr is None:
    return (f"stale: ran at an unknown lr (none in point.json, config.json or metrics.jsonl), "
            f"config says {want['chain']} at {format_lr(want['lr'])}")
  if same_chain:
    return f"stale: ran at lr {format_lr(lr)}, config says {format_lr(want['lr'])}"
  return (f"stale: ran {chain} at lr {format_lr(lr)}, config says {want['chain']} at "
          f"{format_lr(want['lr'])}")


def is_stale(rec: dict[str, Any] | None) -> bool:
  return rec is not None and str(rec.get("status", "")).startswith("stale")


def reconcile(pdir: str, want: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
  """The point's record and `stale_reason` against `want`; a done record that is stale is marked
  so on disk, and one marked stale that `want` describes again is done again."""
  rec = read_record(pdir)
  if rec is None:
    return None, ""
  why = stale_reason(rec, pdir, want)
  if rec.get("status") == "done" or is_stale(rec):
    status = why or "done"
    if rec.get("status") != status:
      rec = dict(rec, status=status)
      write_record(pdir, rec)
  return rec, why


def retire(workdir: str, name: str, rec: dict[str, Any]) -> str:
  """Move a point's earlier run (a stale one) to DIR/stale/<name>.lr<rate>[.k]; returns where."""
  _, lr, _ = ran_at(rec, os.path.join(workdir, name))
  base = os.path.join(workdir, "stale", f"{name}.lr{format_lr(lr)}")
  dest, k = base, 1
  while os.path.exists(dest):
    dest, k = f"{base}.{k}", k + 1
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  os.rename(os.path.join(workdir, name), dest)
  return dest


# --- how long a point takes ----------------------------------------------------------------------

def step_seconds(pdir: str) -> float | None:
  """The median `step_time` a run logged (seconds a step; None if it logged none)."""
  times = [m["step_time"] for m in read_metrics(pdir).values() if m.get("step_time")]
  return statistics.median(times) if times else None


def _runs(pdir: str) -> int:
  """How many times the ladder started the point (its "=== " headers in train.log)."""
  try:
    with open(os.path.join(pdir, "train.log")) as f:
      return sum(line.startswith("=== ") for line in f)
  except FileNotFoundError:
    return 0


def finished_timings(workdir: str) -> list[tuple[dict[str, Any], float]]:
  """(record, seconds a step) of every done point under `workdir` trained in one run (a resumed
  point's record times only its last run) that logged its step time."""
  out = []
  for root, _, files in os.walk(workdir):
    if "point.json" not in files:
      continue
    rec = read_record(root)
    if (rec and (rec.get("status") == "done" or is_stale(rec)) and rec.get("seconds")
        and rec.get("steps") and _runs(root) == 1):
      per_step = step_seconds(root)
      if per_step:
        out.append((rec, per_step))
  return out


def _arm(rec: dict[str, Any]) -> str:
  """What besides the size sets a point's time: a sweep's chain (not its rate), an ablation's
  switch; '' for a grid point."""
  return {"sweep": rec.get("chain", ""), "ablation": rec.get("ablation", "")}.get(rec.get("kind"), "")


def estimate_seconds(point, jobs: int, timings: list[tuple[dict[str, Any], float]]) -> float | None:
  """`point`'s wall time by the finished points of its size run `jobs` at once
  (`finished_timings`), those of its arm (`_arm`) if there are any: median seconds a step × its
  steps + median seconds outside the steps. With `jobs` > 1 and no such point, `jobs` × its time
  run alone, an upper bound while the runs share one device (2026-12-03: 4 at once took 3.1× their
  time alone each), so the first points of a new `--jobs` start only where even that fits. None
  when there is no point to time it by."""
  def at(j):
    size = [(rec, s) for rec, s in timings
            if rec.get("size") == point.size and rec.get("jobs", 1) == j]
    same = [(rec, s) for rec, s in size if _arm(rec) == _arm(dataclasses.asdict(point))] or size
    if not same:
      return None
    per_step = statistics.median(s for _, s in same)
    fixed = statistics.median(max(rec["seconds"] - rec["steps"] * s, 0.0) for rec, s in same)
    return fixed + point.steps * per_step
  own = at(jobs)
  if own is not None or jobs == 1:
    return own
  alone = at(1)
  return None if alone is None else jobs * alone


def with_margin(seconds: float) -> float:
  """A point's estimate with room for run-to-run spread: a point stopped at the deadline loses its
  work where the machine goes (2026-12-03: an 84 s estimate started with 85 s left ran 88 s). The
  points of one size and chain spread by ~±5 % (79-88 s at the :gpu grid's L8d256)."""
  return 1.1 * seconds + 10.0


# --- several at once: jobs, device, memory, order -----------------------------------------------

def check_jobs(jobs: int) -> None:
  if jobs < 1:
    raise LadderError(f"--jobs={jobs}: the number of points trained at once must be 1 or more")


def check_names(points) -> None:
  """Every point its own work directory."""
  seen, twice = set(), set()
  for p in points:
    (twice if p.name in seen else seen).add(p.name)
  if twice:
    raise LadderError(f"points share a work directory: {', '.join(sorted(twice))}")


@dataclasses.dataclass(frozen=True)
class Device:
  platform: str      # jax's platform of the runs' devices: "cpu", "gpu", "tpu"
  count: int         # devices one run sees (its mesh spans them)
  bytes: float       # memory of one device: the GPU's, or the host's on the CPU


_PROBE = ("import jax; d = jax.devices(); s = d[0].memory_stats() or {}; "
          "print(d[0].platform, len(d), s.get('bytes_limit', 0))")


def probe_device(env: dict[str, str]) -> Device:
  """The devices a point's run sees, asked by a short process with the runs' environment (with
  preallocation off and the whole memory as its limit, so `bytes_limit` is the device's memory)."""
  probe_env = dict(env, **{PREALLOCATE: "false", MEM_FRACTION: "1.0"})
  p = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=probe_env,
                     capture_output=True, text=True, timeout=300)
  words = p.stdout.split()
  if p.returncode or len(words) < 3:
    last = (p.stderr.strip().splitlines() or ["no output"])[-1]
    raise LadderError(f"cannot see the devices the runs would use (exit {p.returncode}): {last}")
  platform, count, limit = words[-3], int(words[-2]), float(words[-1])
  if not limit:  # the CPU: the host's memory
    limit = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  return Device(platform, count, limit)


def run_fraction(jobs: int, env: dict[str, str]) -> float:
  """The share of a GPU's memory each run may take: the environment's, else 0.9 / jobs."""
  return float(env[MEM_FRACTION]) if env.get(MEM_FRACTION) else GPU_SHARE / jobs


def child_env(env: dict[str, str], device: Device, jobs: int) -> dict[str, str]:
  """The runs' environment with `jobs` going at once: on a GPU, allocation on demand up to
  `run_fraction` each; unchanged on the CPU or with one at a time."""
  if jobs == 1 or device.platform == "cpu":
    return env
  out = dict(env)
  out.setdefault(PREALLOCATE, "false")
  out.setdefault(MEM_FRACTION, f"{GPU_SHARE / jobs:.4g}")
  return out


def _fits(need: list[tuple[float, str]], jobs: int, device: Device, env: dict[str, str]) -> str:
  """'' if the `jobs` largest of `need` ((bytes, point), largest first) fit the device, else why
  not."""
  gib = lambda b: f"{b / 2**30:.1f} GiB"
  top = need[:jobs]
  if device.platform != "cpu":
    fraction = run_fraction(jobs, env)
    if top[0][0] > fraction * device.bytes:
      return (f"{top[0][1]} needs {gib(top[0][0])}, more than the {gib(fraction * device.bytes)} "
              f"each run gets ({MEM_FRACTION}={fraction:.4g})")
  total = sum(b for b, _ in top)
  if total > device.bytes:
    return (f"the {len(top)} largest runs need {gib(total)} at once (the largest, {top[0][1]}: "
            f"{gib(top[0][0])})")
  return ""


def check_fit(need: dict[str, float], jobs: int, device: Device, env: dict[str, str]) -> None:
  """Raise LadderError (one line) unless `jobs` runs at once fit `device` by their memory plans
  (`need`: point name -> bytes per device; see the module docstring)."""
  if device.platform == "tpu":
    raise LadderError(f"--jobs={jobs}: a TPU serves one process at a time; use --jobs=1")
  if not need:
    return
  ranked = sorted(((b, n) for n, b in need.items()), key=lambda x: -x[0])
  why = _fits(ranked, jobs, device, env)
  if not why:
    return
  fit = next((k for k in range(jobs - 1, 0, -1) if not _fits(ranked, k, device, env)), 0)
  advice = f"at most --jobs={fit} fit" if fit else "not even one run fits"
  raise LadderError(
      f"--jobs={jobs} does not fit one {device.platform} device of {device.bytes / 2**30:.1f} GiB "
      f"by the memory plan (launch.memory_plan: parameters, gradients, optimizer state and "
      f"activations, an estimate): {why}; {advice}; nothing was run")


def longest_first(points, described: dict[str, dict[str, Any]]) -> list:
  """The points by compute, the most first (a stable sort: ties keep the plan's order)."""
  return sorted(points, key=lambda p: -described[p.name]["compute"])


# --- the runner -----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Run:
  number: int
  point: Any
  pdir: str
  record: dict[str, Any]
  t0: float
  out: Any = None                         # the open train.log the process writes to
  proc: subprocess.Popen | None = None


def run(points, commands: dict[str, list[str]], described: dict[str, dict[str, Any]], grid: str,
        workdir: str, env: dict[str, str], log, jobs: int = 1,
        deadline: float | None = None) -> list[dict[str, Any]]:
  """Run every point not yet done, at most `jobs` at once, in the order given; their records in
  that order (a point the `deadline`, a `time.time()`, leaves out: status "not started", not
  written to its directory). See the module docstring."""
  check_jobs(jobs)
  check_names(points)
  queue = list(enumerate(points, 1))
  running: list[_Run] = []
  records: dict[str, dict[str, Any]] = {}
  try:
    while queue or running:
      timings = None   # read once per round of starts: points finish between rounds
      while queue and len(running) < jobs:
        number, p = queue.pop(0)
        pdir = os.path.join(workdir, p.name)
        old, stale = reconcile(pdir, described[p.name])
        if old is not None and old.get("status") == "done":
          log(f"[{number}/{len(points)}] {p.name}: done, skipped")
          records[p.name] = old
          continue
        if deadline is not None:
          left = deadline - time.time()
          timings = finished_timings(workdir) if timings is None else timings
          need = estimate_seconds(p, jobs, timings)
          if left <= 0 or (need is not None and with_margin(need) > left):
            log(f"[{number}/{len(points)}] {p.name}: not started: "
                + (f"needs ~{need:.0f} s by the finished points of its size "
                   f"({with_margin(need):.0f} s with the margin), " if need is not None else "")
                + f"{max(left, 0):.0f} s left")
            records[p.name] = dict(old or {"name": p.name}, status="not started")
            continue
        if stale:
          log(f"[{number}/{len(points)}] {p.name}: {stale}; its run ({old.get('status')}) moved "
              f"to {retire(workdir, p.name, old)}, starting afresh")
        _start(running, number, len(points), p, pdir, commands[p.name], described[p.name],
               grid, env, jobs, log)
      if not running:
        break
      try:
        running[0].proc.wait(timeout=_POLL_S)
      except subprocess.TimeoutExpired:
        pass
      for r in [r for r in running if r.proc.poll() is not None]:
        running.remove(r)
        records[r.point.name] = _finish(r, len(points), log)
      if deadline is not None and running and time.time() >= deadline:
        raise TimeLimit(", ".join(r.point.name for r in running))
  except BaseException:
    _stop(running, len(points), log)
    raise
  return [records[p.name] for p in points]


def _start(running: list[_Run], number: int, total: int, p, pdir: str, cmd: list[str],
           described: dict[str, Any], grid: str, env: dict[str, str], jobs: int, log) -> None:
  logfile = os.path.join(pdir, "train.log")
  record = dict(dataclasses.asdict(p), **described, command=" ".join(cmd[1:]),
                xla_flags=env.get("XLA_FLAGS", ""), log=logfile, status="running", grid=grid)
  if jobs > 1:
    record["jobs"] = jobs  # its seconds were shared with up to jobs - 1 other runs
  write_record(pdir, record)
  log(f"[{number}/{total}] {p.name}: {' '.join(cmd[1:])}")
  r = _Run(number, p, pdir, record, time.time(), out=open(logfile, "a"))
  running.append(r)  # before the process exists, so an interrupt from here on stops it
  r.out.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
  r.out.flush()
  r.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=r.out, stderr=subprocess.STDOUT)


def _finish(r: _Run, total: int, log) -> dict[str, Any]:
  rc = r.proc.returncode
  r.out.close()
  ev = final_eval(r.pdir, r.point.steps)
  ok = rc == 0 and ev is not None
  r.record.update(status="done" if ok else "failed", returncode=rc,
                  seconds=time.time() - r.t0, **(ev or {}))
  write_record(r.pdir, r.record)
  log(f"[{r.number}/{total}] {r.point.name}: {r.record['status']} in {time.time() - r.t0:.0f} s"
      + (f": eval loss {ev['eval_loss']:.4f}" if ok
         else f" (exit {rc}; log {r.record['log']})"))
  return r.record


def _stop(running: list[_Run], total: int, log) -> None:
  """SIGTERM to every running process; each point recorded as interrupted, then waited for (a
  run that finished meanwhile is recorded done)."""
  for r in running:
    if r.proc is not None and r.proc.poll() is None:
      r.proc.terminate()  # launch.train saves a checkpoint on SIGTERM and exits
  for r in running:
    r.record.update(status="interrupted", seconds=time.time() - r.t0)
    write_record(r.pdir, r.record)
  for r in running:
    if r.proc is None:
      r.out.close()
      continue
    rc = r.proc.wait()
    if rc == 0 and final_eval(r.pdir, r.point.steps) is not None:
      _finish(r, total, log)
      continue
    r.out.close()
    r.record.update(seconds=time.time() - r.t0)
    write_record(r.pdir, r.record)
