"""One batch of look-ahead for the train loop: the host builds batch n + 1 while the device runs
step n, and a checkpoint of step n still records the data position after batch n.

    it = Lookahead(make_train_iterator(...))
    rows = next(it)                  # batch n (the peeked one, if any)
    dispatch step n                  # jax returns before the device is done
    it.peek()                        # batch n + 1 on the host, beside the device's work
    block on step n's metrics; checkpoint with `it`: its state is the one before the peek

The train loop reads a step's metrics (`finite`) right after dispatching it, so without the peek
the host's packing, tokenizing and Engram ids for the next batch ran only once the device was idle:
on one H200, s3 at 8 x (4 x 4096) rows spent 1.0-2.2 s of a 4.0-5.1 s step waiting for data
(benchmarks/gpu_runs/2026-12-02d/call4). The peek is single-threaded and deterministic: the rows
are the wrapped iterator's, in its order, whatever the timing.

`get_state` and `counters` answer for the position before a pending peek (a snapshot taken just
before it), so a save, a resume and the logged counts are those of the batches handed out;
`set_state` drops a pending peek.
"""

from __future__ import annotations

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

  def peek(self) -> Any:
    """The next batch, built now and handed out by the next `__next__`; None at the end (the
    next `__next__` asks the wrapped iterator again, which raises StopIteration)."""
    if not self._has_peek:
      state = self.inner.get_state()
      counters = self.inner.counters()
      try:
        self._peeked = next(self.inner)
      except StopIteration:
        return None
      self._state_before, self._counters_before = state, counters
      self._has_peek = True
    return self._peeked

  @property
  def pending(self) -> bool:
    """Whether a peeked batch waits to be handed out."""
    return self._has_peek

  def __next__(self) -> Any:
    if self._has_peek:
      rows = self._peeked
      self._drop()
      return rows
    return next(self.inner)

  def _drop(self) -> None:
    self._peeked, self._has_peek = None, False
    self._state_before = self._counters_before = None

  def get_state(self) -> dict:
    return self._state_before if self._has_peek else self.inner.get_state()

  def set_state(self, state: dict) -> None:
    self._drop()
    self.inner.set_state(state)

  def counters(self) -> dict:
    return self._counters_before if self._has_peek else self.inner.counters()

  def skip_locations(self) -> dict:
    return self.inner.skip_locations()

  def close(self) -> None:
    self._drop()
    self.inner.close()
