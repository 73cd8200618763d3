"""Tests of data/mixture.py: token shares and weight validation."""

import numpy as np
import pytest

from data import mixture


def test_token_share_tracks_weights_every_prefix():
  rng = np.random.default_rng(0)
  w = mixture.normalized_weights({"text": 7.0, "multimodal": 1.0})
  assert w == {"text": 0.875, "multimodal": 0.125}
  m = mixture.TokenMixer([w["text"], w["multimodal"]])
  taken = np.zeros(2)
  max_len = [4000, 60]
  for step in range(5000):
    s = m.choose()
    n = int(rng.integers(1, max_len[s]))
    m.record(s, n)
    taken[s] += n
    if taken.sum() > 50_000:
      share = taken[1] / taken.sum()
      assert abs(share - 0.125) <= max(max_len) / taken.sum()  # within one document
  np.testing.assert_array_equal(m.taken, taken)


def test_exhausted_stream_is_skipped():
  m = mixture.TokenMixer([0.5, 0.5])
  m.exhaust(0)
  assert all(m.choose() == 1 for _ in range(3))
  m.exhaust(1)
  assert m.done


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_bad_weight_is_an_error_naming_it(bad):
  with pytest.raises(ValueError, match="multimodal_weight"):
    mixture.normalized_weights({"text": 7.0, "multimodal": bad})
