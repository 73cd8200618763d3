"""Confidence-scheduled verification length (docs/design.md §16.4; shared/spec/SOURCES.md, "DSpark").

The drafter's confidence head gives, per request r and draft position i, c_{r,i} ≈ P(d_i accepted
| d_1 … d_{i−1} accepted); the prefix-survival probability S_{r,i} = Π_{j≤i} c_{r,j} is the
chance that draft i is accepted. Verifying k drafts yields 1 + Σ_{i≤k} S_{r,i} tokens in
expectation (the bonus or correction token always comes). A round of R requests at length k
costs τ(R, k) seconds, the engine-throughput curve measured from the project's own decode
(`benchmarks/dspark_throughput.py`). The scheduler picks

    k* = argmax_k  Σ_r (1 + Σ_{i≤k} S_{r,i}) / τ(R, k)

the expected tokens per second of the whole batch at the current load R. This engine runs a
round as one rectangular pass (every request verifies k drafts), so the lengths of requests that
share a pass are chosen together; with one request in flight the choice is per request.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np


def survival(conf_RxK: np.ndarray) -> np.ndarray:
  """S_{r,i} = Π_{j≤i} c_{r,j}."""
  return np.cumprod(np.asarray(conf_RxK, np.float64), axis=-1)


def expected_tokens(survival_RxK: np.ndarray) -> np.ndarray:
  """[R, K+1]: the expected tokens of a round at k = 0 … K, 1 + Σ_{i≤k} S_{r,i}."""
  s = np.asarray(survival_RxK, np.float64)
  return 1.0 + np.concatenate([np.zeros_like(s[:, :1]), np.cumsum(s, axis=-1)], axis=-1)


@dataclasses.dataclass(frozen=True)
class ThroughputCurve:
  """τ(R, k): measured seconds of one speculative round of R requests verifying k drafts each.
  `batches` ascending; `seconds[b][k]` for batch `batches[b]`, k = 0 … K."""

  batches: tuple[int, ...]
  seconds: tuple[tuple[float, ...], ...]
  source: str = ""

  @property
  def max_k(self) -> int:
    return len(self.seconds[0]) - 1

  def at(self, R: int) -> np.ndarray:
    """τ(R, ·) [K+1], linear in R between the measured batches (held at the ends)."""
    b = np.asarray(self.batches, np.float64)
    s = np.asarray(self.seconds, np.float64)
    return np.array([np.interp(R, b, s[:, k]) for k in range(s.shape[1])])

  @classmethod
  def load(cls, path: str) -> "ThroughputCurve":
    with open(path) as f:
      d = json.load(f)
    try:
      curve = cls(tuple(int(x) for x in d["batches"]),
                  tuple(tuple(float(x) for x in row) for row in d["seconds"]), path)
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{path} is not a throughput curve (expected 'batches' and 'seconds' "
                       f"written by benchmarks/dspark_throughput.py): {e}") from None
    if list(curve.batches) != sorted(curve.batches) or len(curve.seconds) != len(curve.batches):
      raise ValueError(f"{path}: 'batches' must ascend with one row of 'seconds' per batch")
    return curve


def choose_length(survival_RxK: np.ndarray, seconds_K1: np.ndarray, max_k: int | None = None
                  ) -> tuple[int, np.ndarray]:
  """(k*, expected tokens per second at each k = 0 … K) for the requests of one pass (module
  docstring); `max_k` caps k (room left in the caches)."""
  tokens = expected_tokens(survival_RxK).sum(axis=0)
  K = min(len(tokens), len(seconds_K1)) - 1
  if max_k is not None:
    K = max(0, min(K, max_k))
  rate = tokens[:K + 1] / np.asarray(seconds_K1, np.float64)[:K + 1]
  return int(np.argmax(rate)), rate
