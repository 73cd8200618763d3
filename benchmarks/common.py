"""What the benchmark scripts share: how a call is timed, the header naming the run, table headers.

Timing (`time_calls`, `median_seconds`): one first call, which compiles and warms up and is timed
apart, then `reps` timed bursts of calls dispatched back to back and waited on once with
`jax.block_until_ready` (so asynchronous dispatch never hides device time); a script reports the
median over the bursts of a burst's time per call. On an accelerator a burst holds enough calls for
~2 ms (at most 32; one for a call that takes longer), so a short call's dispatch latency overlaps
the previous call's device work instead of being added to it; on the CPU backend, whose queued
calls may run at once on the host's threads, a burst is one call. Until session 64 every call was
waited on alone, and −X of s3's bfloat16 mHC streams (134 MB) timed 0.276 ms on an H100 that way
against 0.101 ms back to back (RESULTS.md, session 64): GPU rows measured before then include up to
~0.17 ms a call.

The header (`header`: `command` and `machine`) gives the command line and the machine (date in
UTC, jax version, backend, devices, host cores), so every printed table says where its figures
come from.

Arms timed in turn (`Turns`, `gpu_step.py --turn DIR:N`): N processes that share DIR prepare and
compile at once, then time one at a time.

Imports only the standard library, numpy and jax, so GPU-only scripts run without the data stack.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import sys
import time
from typing import Callable

import jax
import numpy as np

START = time.perf_counter()


def elapsed() -> float:
  """Seconds since the benchmark started (since this module was imported)."""
  return time.perf_counter() - START


def log(msg: str) -> None:
  """A progress line on stderr: wall-clock time and seconds since the start."""
  print(f"[{time.strftime('%H:%M:%S')} +{elapsed():.0f}s] {msg}", file=sys.stderr, flush=True)


def time_calls(fn: Callable, *args, reps: int, burst: int | None = None) -> tuple[float, float]:
  """(median over `reps` bursts of a burst's seconds per call of `fn(*args)`, seconds of the first
  call before them, which compiles and warms up). `burst` calls are dispatched back to back and
  waited on once; None picks it from one more call waited on alone: ⌈2 ms / that call⌉, 1 to 32,
  and 1 on the CPU backend (module docstring). `burst=1` waits on every call."""
  if burst is not None and burst < 1:
    raise ValueError(f"burst must be at least 1 call, got {burst}")
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  if burst is None and jax.default_backend() == "cpu":
    burst = 1
  if burst is None:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    burst = int(min(32, max(1, np.ceil(2e-3 / max(one, 1e-7)))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(burst - 1):
      fn(*args)          # dispatched; its outputs are released once the device is done with them
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) / burst)
  return float(np.median(times)), first


def median_seconds(fn: Callable, *args, reps: int) -> float:
  """Median seconds of `reps` calls of `fn(*args)` after one compile-and-warm-up call."""
  return time_calls(fn, *args, reps=reps)[0]


def command() -> str:
  """The command line that is running, as typed from the repository root."""
  return " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def machine() -> str:
  """Date (UTC), jax version, backend, devices and host cores."""
  devices = jax.devices()
  return (f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, jax {jax.__version__}, "
          f"{jax.default_backend()} backend, {len(devices)} × {devices[0].device_kind}, "
          f"{os.cpu_count()} host cores")


def header() -> str:
  """Two lines to print above a table: `command()` and `machine()`."""
  return f"command: {command()}\nmachine: {machine()}"


def md_header(*columns: str) -> str:
  """A markdown table's header row and separator."""
  return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def set_overrides(cfg, items) -> None:
  """Apply "a.b.c=value" items to a ConfigDict `cfg` in place (`--set` of the step benchmarks):
  the value is parsed as the type of the value it replaces (bool: true / false; a tuple: comma-
  separated strings; a None field takes the string). An unknown key or a bad value is a one-line
  SystemExit naming the item."""
  for item in items:
    key, sep, text = item.partition("=")
    *path, leaf = key.split(".")
    node = cfg
    try:
      for part in path:
        node = node[part]
      old = node[leaf]
    except (KeyError, AttributeError, TypeError):
      raise SystemExit(f"error: --set {item}: no config key {key!r}") from None
    if not sep:
      raise SystemExit(f"error: --set {item}: expected key=value")
    try:
      if isinstance(old, bool):
        if text.lower() not in ("true", "false"):
          raise ValueError(text)
        value = text.lower() == "true"
      elif isinstance(old, tuple):
        value = tuple(s for s in text.split(",") if s)
      else:
        value = text if old is None else type(old)(text)
    except ValueError:
      raise SystemExit(f"error: --set {item}: {text!r} does not parse as "
                       f"{type(old).__name__}") from None
    node[leaf] = value


class Turns:
  """N processes sharing `DIR` (the spec "DIR:N"): each builds and compiles its program at once
  with the others, then times it alone. Each process registers in DIR when it starts (`Turns`);
  `turn(i)` marks its i-th program compiled, waits until every registered process that is still
  alive has marked its i-th (and N have registered, or `start_s` passed), at most `wait_s`
  seconds, then holds an exclusive lock on DIR/lock for its block. An arm that dies (out of
  memory while compiling) is not waited for."""

  def __init__(self, spec: str, wait_s: float = 600.0, start_s: float = 60.0):
    where, _, n = spec.rpartition(":")
    if not where or not n.isdigit() or int(n) < 1:
      raise SystemExit(f"error: --turn takes DIR:N (N processes share DIR), got {spec!r}")
    self.dir, self.n, self.wait_s, self.start_s = where, int(n), wait_s, start_s
    os.makedirs(self.dir, exist_ok=True)
    open(os.path.join(self.dir, f"arm.{os.getpid()}"), "w").close()
    self.t0 = time.monotonic()

  def _waiting_for(self, index: int) -> list[int]:
    """The registered processes, alive, that have not marked their `index`-th program."""
    pids = [int(p.rsplit(".", 1)[1]) for p in glob.glob(os.path.join(self.dir, "arm.*"))]
    ready = os.path.join(self.dir, f"ready.{index}.{{}}")
    return [p for p in pids if not os.path.exists(ready.format(p)) and _alive(p)]

  @contextlib.contextmanager
  def turn(self, index: int):
    open(os.path.join(self.dir, f"ready.{index}.{os.getpid()}"), "w").close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < self.wait_s:
      started = (len(glob.glob(os.path.join(self.dir, "arm.*"))) >= self.n
                 or time.monotonic() - self.t0 > self.start_s)
      if started and not self._waiting_for(index):
        break
      time.sleep(0.2)
    with open(os.path.join(self.dir, "lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)        # no signal: only whether the process exists
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, another user's
    pass
  return True
