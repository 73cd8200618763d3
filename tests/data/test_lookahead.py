"""Tests of data/lookahead.py: a peeked batch changes neither the batches, nor what a checkpoint
records, nor the logged counts."""

import json

import grain
import orbax.checkpoint as ocp
import pytest

from data import pipeline
from data.lookahead import Lookahead
from tests.data.conftest import make_data
from tests.data.test_pipeline import assert_batches_equal, take


def test_batches_are_the_wrapped_iterators(corpus_dir, small_tok):
  cfg = make_data(corpus_dir)
  plain = take(pipeline.make_train_iterator(cfg, tokenizer=small_tok), 8)
  it = Lookahead(pipeline.make_train_iterator(cfg, tokenizer=small_tok))
  got = []
  for i in range(8):              # peeks between some batches, on a thread or not, twice once
    got.append(next(it))
    if i % 3 == 0:
      it.start_peek()
      it.start_peek()             # a second start while one runs or waits is a no-op
    elif i % 3 == 1:
      it.peek()
    if i == 4:
      it.peek()
  assert_batches_equal(got, plain)


class _Failing(grain.DatasetIterator):
  def __init__(self):
    super().__init__()
    self.calls = 0

  def __next__(self):
    self.calls += 1
    raise OSError("bad shard")

  def get_state(self):
    return {"calls": self.calls}

  def set_state(self, state):
    self.calls = state["calls"]

  def counters(self):
    return {}


def test_background_peek_error_is_raised_by_the_joining_call():
  it = Lookahead(_Failing())
  it.start_peek()
  with pytest.raises(OSError, match="bad shard"):
    it.peek()
  assert not it.pending            # raised once; the iterator is usable again
  it.start_peek()
  with pytest.raises(OSError, match="bad shard"):
    next(it)


@pytest.mark.parametrize("background", [False, True])
def test_state_and_counters_are_before_the_peek(corpus_dir, small_tok, background):
  """With `start_peek` the readers join the thread: state and counters are read while it may
  still be building, and equal the synchronous peek's."""
  cfg = make_data(corpus_dir)
  ref = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  take(ref, 5)
  it = Lookahead(pipeline.make_train_iterator(cfg, tokenizer=small_tok))
  take(it, 5)
  if background:
    it.start_peek()
  else:
    it.peek()
  assert it.get_state() == ref.get_state()
  assert it.counters() == ref.counters() and it.counters()["rows"] == 5 * 4
  assert it.pending and it.host_seconds > 0
  peeked = it.peek()
  # What a checkpoint stores resumes at the peeked batch, and after it as the plain iterator.
  state = json.loads(json.dumps(it.get_state()))
  fresh = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  fresh.set_state(state)
  expect = take(ref, 4)
  assert_batches_equal([peeked], expect[:1])
  assert_batches_equal(take(fresh, 4), expect)
  assert_batches_equal(take(it, 4), expect)
  assert it.counters() == ref.counters()
  it.start_peek()
  it.set_state(ref.get_state())    # drops a background peek
  assert not it.pending
  assert_batches_equal(take(it, 2), take(ref, 2))


def test_orbax_save_after_a_peek_resumes_exactly(corpus_dir, small_tok, tmp_path):
  cfg = make_data(corpus_dir)
  it = Lookahead(pipeline.make_train_iterator(cfg, tokenizer=small_tok))
  take(it, 3)
  it.peek()
  mgr = ocp.CheckpointManager(str(tmp_path / "ckpt"),
                              options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
  mgr.save(3, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(it)))
  mgr.wait_until_finished()
  expect = take(it, 3)
  fresh = Lookahead(pipeline.make_train_iterator(cfg, tokenizer=small_tok))
  fresh.peek()                     # a pending peek is dropped by the restore
  mgr.restore(3, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(fresh)))
  assert not fresh.pending
  assert_batches_equal(take(fresh, 3), expect)
  assert fresh.counters() == it.counters()
