"""Tests of data/lookahead.py: a peeked batch changes neither the batches, nor what a checkpoint
records, nor the logged counts."""

import json

import grain
import orbax.checkpoint as ocp

from data import pipeline
from data.lookahead import Lookahead
from tests.data.conftest import make_data
from tests.data.test_pipeline import assert_batches_equal, take


def test_batches_are_the_wrapped_iterators(corpus_dir, small_tok):
  cfg = make_data(corpus_dir)
  plain = take(pipeline.make_train_iterator(cfg, tokenizer=small_tok), 8)
  it = Lookahead(pipeline.make_train_iterator(cfg, tokenizer=small_tok))
  got = []
  for i in range(8):              # peeks between some batches, twice in a row once
    got.append(next(it))
    if i % 3 != 2:
      it.peek()
    if i == 4:
      it.peek()
  assert_batches_equal(got, plain)


def test_state_and_counters_are_before_the_peek(corpus_dir, small_tok):
  cfg = make_data(corpus_dir)
  ref = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  take(ref, 5)
  it = Lookahead(pipeline.make_train_iterator(cfg, tokenizer=small_tok))
  take(it, 5)
  peeked = it.peek()
  assert it.pending
  assert it.get_state() == ref.get_state()
  assert it.counters() == ref.counters() and it.counters()["rows"] == 5 * 4
  # What a checkpoint stores resumes at the peeked batch, and after it as the plain iterator.
  state = json.loads(json.dumps(it.get_state()))
  fresh = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  fresh.set_state(state)
  expect = take(ref, 4)
  assert_batches_equal([peeked], expect[:1])
  assert_batches_equal(take(fresh, 4), expect)
  assert_batches_equal(take(it, 4), expect)
  assert it.counters() == ref.counters()


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
