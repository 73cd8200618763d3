"""One batch of look-ahead for the train loop: the host builds batch n + 1 while the device runs
step n, and a checkpoint of step n still records the data position after batch n.

    it = Lookahead(make_train_iterator(...))
    rows = next(it)                  # batch n (the peeked one, if any)
    it.start_peek()                  # batch n + 1, built on a background thread
    dispatch step n
    it.peek()                        # joins the thread (or builds the batch now, without one)
    block on step n's metrics; checkpoint with `it`: its state is the one before the peek

The train loop reads a step's metrics (`finite`) right after dispatching it, so without the peek
the host's packing, tokenizing and Engram ids for the next batch ran only once the device was idle:
on one H200, s3 at 8 x (4 x 4096) rows spent 1.0-2.2 s of a 4.0-5.1 s step waiting for data
(benchmarks/gpu_runs/2026-12-02d/call4). Peeking on the train loop's own thread after the
dispatch was not enough: the step stayed 3.9-4.3 s against ~2.9 s of device work
(benchmarks/gpu_runs/2026-12-03/call1), because the dispatch itself returned only with the step
(the cause is not isolated: XLA command buffers that take the layer scans' loops and conditionals
left it as it was, benchmarks/RESULTS.md 2026-12-03). So the peek runs on a thread started before the dispatch, which leaves the GIL while
it waits. It is deterministic all the same: one peek at a time, the rows are the wrapped
iterator's, in its order, whatever the timing; every other method joins the thread first, and an
error raised while building the batch is raised again by the call that joins it.

`get_state` and `counters` answer for the position before a pending peek (a snapshot taken just
before it), so a save, a resume and the logged counts are those of the batches handed out;
`set_state` drops a pending peek.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grain


class Lookahead(grain.DatasetIterator):
  """Wraps a checkpointable iterator (`data.pipeline.PackedIterator`) with one peeked batch."""

  def __init__(self, it: grain.DatasetIterator):
    super().__init__(it)
    self.inner = it
    self._peeked: Any = None
    self._has_peek = False
    self._state_before: dict | None = None
    self._counters_before: dict | None = None
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.host_seconds = 0.0   # the last peek's time building the batch, on whichever thread

  def start_peek(self) -> None:
    """Begins the peek on a background thread (no-op when a peek is pending or under way)."""
    if self._has_peek or self._thread is not None:
      return
    self._thread = threading.Thread(target=self._peek_in_thread, name="lookahead", daemon=True)
    self._thread.start()

  def _peek_in_thread(self) -> None:
    try:
      self._peek()
    except BaseException as e:  # noqa: BLE001 -- raised again on the joining thread
      self._error = e

  def _join(self, reraise: bool = True) -> None:
    if self._thread is not None:
      self._thread.join()
      self._thread = None
      error, self._error = self._error, None
      if error is not None and reraise:
        raise error

  def peek(self) -> Any:
    """The next batch, handed out by the next `__next__`: the background peek's (joined), or
    built now; None at the end (the next `__next__` asks the wrapped iterator again, which raises
    StopIteration)."""
    self._join()
    return self._peek()

  def _peek(self) -> Any:
    if not self._has_peek:
      t0 = time.perf_counter()
      state = self.inner.get_state()
      counters = self.inner.counters()
      try:
        self._peeked = next(self.inner)
      except StopIteration:
        return None
      finally:
        self.host_seconds = time.perf_counter() - t0
      self._state_before, self._counters_before = state, counters
      self._has_peek = True
    return self._peeked

  @property
  def pending(self) -> bool:
    """Whether a peeked batch waits to be handed out (joins a background peek)."""
    self._join()
    return self._has_peek

  def __next__(self) -> Any:
    self._join()
    if self._has_peek:
      rows = self._peeked
      self._drop()
      return rows
    return next(self.inner)

  def _drop(self) -> None:
    self._peeked, self._has_peek = None, False
    self._state_before = self._counters_before = None

  def get_state(self) -> dict:
    self._join()
    return self._state_before if self._has_peek else self.inner.get_state()

  def set_state(self, state: dict) -> None:
    self._join(reraise=False)   # a failed peek past the restored position is moot
    self._drop()
    self.inner.set_state(state)

  def counters(self) -> dict:
    self._join()
    return self._counters_before if self._has_peek else self.inner.counters()

  def skip_locations(self) -> dict:
    self._join()
    return self.inner.skip_locations()

  def close(self) -> None:
    self._join(reraise=False)
    self._drop()
    self.inner.close()
