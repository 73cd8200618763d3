"""Token-share mixture of the data streams (docs/design.md §T3: text : multimodal = 7 : 1 in tokens).

grain's `IterDataset.mix` weights count elements, so a token share needs each stream's mean
length and only lands near its target. `TokenMixer` decides in tokens directly: the next document
comes from the stream furthest behind its share, `argmax_i(w_i * T - t_i)` with `t_i` the tokens
taken from stream `i` so far and `T = sum_i t_i` (ties to the lowest index). The share of every
prefix of the stream then stays within one document of `w_i`, deterministically.
"""

from __future__ import annotations

import numpy as np


def normalized_weights(weights: dict[str, float]) -> dict[str, float]:
  """Weights scaled to sum 1; a weight that is not > 0 is an error naming it."""
  for name, w in weights.items():
    if not (isinstance(w, (int, float)) and np.isfinite(w) and w > 0):
      raise ValueError(f"mixture weight data.{name}_weight={w!r} must be a finite number > 0")
  total = float(sum(weights.values()))
  return {name: float(w) / total for name, w in weights.items()}


class TokenMixer:
  """Chooses which stream supplies the next document; state = tokens taken per stream."""

  def __init__(self, weights: list[float]):
    self.weights = np.asarray(weights, np.float64)
    self.taken = np.zeros(len(weights), np.int64)
    self.active = np.ones(len(weights), bool)

  def choose(self) -> int:
    deficit = self.weights * self.taken.sum() - self.taken
    deficit[~self.active] = -np.inf
    return int(np.argmax(deficit))

  def record(self, stream: int, tokens: int) -> None:
    self.taken[stream] += tokens

  def exhaust(self, stream: int) -> None:
    """A finite stream ended (evaluation); the others continue."""
    self.active[stream] = False

  @property
  def done(self) -> bool:
    return not self.active.any()

  def get_state(self) -> dict:
    return {"taken": self.taken.tolist(), "active": self.active.tolist()}

  def set_state(self, state: dict) -> None:
    self.taken = np.asarray(state["taken"], np.int64)
    self.active = np.asarray(state["active"], bool)
