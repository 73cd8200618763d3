"""Held-out evaluation figures and the metric log, against direct computations (no model)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from data.tokenizer import TokenizerHandle, train_bpe
from launch import evaluation, metrics


@pytest.fixture(scope="module")
def tok():
  rng = np.random.default_rng(0)
  words = ["naïve", "café", "東京", "größe", "def", "return", "x = 1", "✓ ok", "emoji 🙂", "Ωmega"]
  texts = [" ".join(rng.choice(words, 30)) for _ in range(200)]
  return TokenizerHandle(train_bpe(texts, 300), "test")


def test_token_byte_lengths_sum_to_utf8_length(tok):
  """Summed over any text's tokens, the per-token byte counts give the text's UTF-8 length
  (tokens that split a multi-byte character included); specials and unused ids count 0."""
  vocab = tok.vocab_size + 7
  lengths = evaluation.token_byte_lengths(tok, vocab)
  rng = np.random.default_rng(1)
  alphabet = list("abc xyz=()\n") + ["é", "ß", "東", "京", "🙂", "✓", "Ω", "\u0301"]
  for _ in range(50):
    text = "".join(rng.choice(alphabet, rng.integers(1, 40)))
    ids = tok.encode(text)
    assert int(lengths[ids].sum()) == len(text.encode("utf-8")), text
  assert all(lengths[i] == 0 for i in tok.special_ids.values())
  assert (lengths[tok.vocab_size:] == 0).all()


def test_evaluate_sums_before_dividing():
  rng = np.random.default_rng(2)
  batches = [(rng.uniform(10, 100), rng.integers(5, 50), rng.integers(10, 200)) for _ in range(6)]

  class It:
    closed = False

    def __iter__(self):
      return iter(batches)

    def close(self):
      self.closed = True

  it = It()
  out = evaluation.evaluate(lambda b: b, it, max_batches=4)
  nats = sum(b[0] for b in batches[:4])
  n = sum(b[1] for b in batches[:4])
  n_bytes = sum(b[2] for b in batches[:4])
  assert out["loss"] == pytest.approx(nats / n, rel=1e-12)
  assert out["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-12)
  assert out["tokens"] == n and it.closed
  everything = evaluation.evaluate(lambda b: b, iter(batches), max_batches=0)
  assert everything["tokens"] == sum(b[1] for b in batches)


def test_mfu_and_peak():
  assert metrics.peak_flops_per_device("NVIDIA H200", 0.0) == 989e12
  assert metrics.peak_flops_per_device("cpu", 0.0) is None
  assert metrics.peak_flops_per_device("cpu", 5e11) == 5e11
  assert metrics.mfu(6e9, 1e4, 8, None) is None
  assert metrics.mfu(6e9, 1e4, 8, 1e14) == pytest.approx(6e9 * 1e4 / (8 * 1e14), rel=1e-12)


def test_metric_writer_jsonl(tmp_path):
  """Scalars as they are, arrays per index, nested dicts by path, non-finite floats as null."""
  w = metrics.MetricWriter(str(tmp_path), enabled=True)
  w.write(3, {"loss": np.float32(2.5), "finite": np.asarray(True), "nan": float("nan"),
              "load": np.asarray([[1.0, 2.0]]), "data": {"rows": 8}})
  w.close()
  with open(tmp_path / "metrics.jsonl") as f:
    rec = json.loads(f.readline())
  assert rec == {"step": 3, "loss": 2.5, "finite": True, "nan": None, "load/0/0": 1.0,
                 "load/0/1": 2.0, "data/rows": 8}
  assert metrics.MetricWriter(str(tmp_path / "off"), enabled=False).jsonl is None


def test_metric_writer_rolls_back_a_lost_runs_steps(tmp_path):
  """Resuming at step 2 after a run that logged up to step 4 (and died mid-line): the records of
  steps 3 and 4 and the torn line leave metrics.jsonl, what follows is appended once."""
  w = metrics.MetricWriter(str(tmp_path), enabled=True)
  for step in range(1, 5):
    w.write(step, {"loss": float(step)})
  w.write(2, {"eval/loss": 9.0})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 5, "lo')
  w = metrics.MetricWriter(str(tmp_path), enabled=True, rollback_to=2)
  w.write(3, {"loss": 30.0})
  w.close()
  with open(tmp_path / "metrics.jsonl") as f:
    recs = [json.loads(line) for line in f]
  assert [(r["step"], r.get("loss")) for r in recs] == [(1, 1.0), (2, 2.0), (2, None), (3, 30.0)]
