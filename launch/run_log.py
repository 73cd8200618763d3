"""A training run's log: the terminal, `WORKDIR/train.log`, and the libraries' noise.

* The `dsv41.*` loggers write to the terminal (stderr, `launch.train.main` installs that handler)
  and to the work directory's `train.log` (process i > 0: `train.process-<i>.log`), the summary and
  a stopping error included.
* The file is opened only when the run commits to training (`RunLog.open_file`, once the first
  step is certain to start); until then the records wait in memory, so a start that fails leaves
  the work directory as it was. When stderr already goes to that file (`launch.ladder` redirects a
  point's output there), only what the terminal does not show is added, so nothing is doubled.
* `RunLog.quiet()`: while it is active, what libraries report through Python -- log records
  (orbax's and asyncio's tracebacks during a failed checkpoint read), warnings (`coroutine ... was
  never awaited`), unraisable exceptions and exceptions in threads (`Event loop is closed`) -- goes
  to train.log only; the terminal keeps the run's own one-line warnings.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import logging.handlers
import os
import sys
import threading
import traceback
import warnings

import jax

FORMAT = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
DETAIL = "dsv41.detail"  # the logger of what `quiet` captures: train.log only
logging.getLogger(DETAIL).propagate = False  # never the terminal; outside a run, nowhere
logging.getLogger(DETAIL).addHandler(logging.NullHandler())


class _Sink(logging.Handler):
  """Forwards records to the run's current sink (the memory buffer, then the file)."""

  def __init__(self, run_log: "RunLog"):
    super().__init__()
    self.run_log = run_log

  def emit(self, record):
    self.run_log.sink.handle(record)


class RunLog:
  """The `dsv41` logger's train.log (see the module docstring); `close()` detaches it."""

  def __init__(self):
    self.logger = logging.getLogger("dsv41")
    self.buffer = logging.handlers.MemoryHandler(capacity=10**7, flushLevel=logging.CRITICAL + 1)
    self.buffer.setFormatter(FORMAT)
    self.sink: logging.Handler = self.buffer
    self.forward = _Sink(self)
    self.logger.addHandler(self.forward)
    self.detail = logging.getLogger(DETAIL)
    self.detail.addHandler(self.forward)
    self.file: logging.Handler | None = None

  def open_file(self, workdir: str) -> None:
    """Start writing train.log (appending: a resumed run continues it), the held records first."""
    index = jax.process_index()
    path = os.path.join(workdir, "train.log" if index == 0 else f"train.process-{index}.log")
    if _same_file(sys.stderr, path):  # the terminal handler writes the dsv41 lines there already
      handler = logging.StreamHandler(sys.stderr)
      handler.addFilter(lambda r: r.name == DETAIL or not r.name.startswith("dsv41"))
    else:
      handler = self.file = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(FORMAT)
    self.buffer.setTarget(handler)
    self.buffer.flush()
    self.buffer.buffer.clear()
    self.sink = handler

  def write(self, text: str) -> None:
    """Plain lines (the summary, an error) into train.log once it is open."""
    if self.file is not None:
      self.file.stream.write(text.rstrip("\n") + "\n")
      self.file.flush()

  def close(self) -> None:
    self.logger.removeHandler(self.forward)
    self.detail.removeHandler(self.forward)
    if self.file is not None:
      self.file.close()

  @contextlib.contextmanager
  def quiet(self):
    """Route the libraries' reports to train.log only (see the module docstring)."""
    root = logging.getLogger()
    saved = root.handlers[:], sys.unraisablehook, threading.excepthook, warnings.showwarning
    root.handlers = [self.forward]

    def unraisable(u):
      self.detail.warning("%s: %s\n%s", u.err_msg or "unraisable exception", u.object,
                          "".join(traceback.format_exception(u.exc_type, u.exc_value,
                                                             u.exc_traceback)))

    def in_thread(a):
      self.detail.warning("exception in thread %s\n%s", a.thread.name if a.thread else "?",
                          "".join(traceback.format_exception(a.exc_type, a.exc_value,
                                                             a.exc_traceback)))

    def warning(message, category, filename, lineno, file=None, line=None):
      self.detail.warning("%s", warnings.formatwarning(message, category, filename, lineno, line))

    sys.unraisablehook, threading.excepthook, warnings.showwarning = unraisable, in_thread, warning
    try:
      yield
    finally:
      gc.collect()  # a failed read's abandoned coroutines report here, still quietly
      root.handlers, sys.unraisablehook, threading.excepthook, warnings.showwarning = saved


def _same_file(stream, path: str) -> bool:
  """Whether `stream` (stderr) writes to `path` already."""
  try:
    return os.path.exists(path) and os.path.samestat(os.fstat(stream.fileno()), os.stat(path))
  except (OSError, ValueError, AttributeError):  # no file descriptor (pytest's capture)
    return False
