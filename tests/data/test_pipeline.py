"""Tests of data/pipeline.py: batch layout, exact resume, process sharding, bad input."""

import base64
import collections
import json
import os

import numpy as np
import pytest

from data import documents, pipeline, records
from tests.data.conftest import make_cfg, make_data, mm_record, text_records, write_jsonl


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def check_row_layout(batch, tok, seq_len):
  for r in range(batch["tokens"].shape[0]):
    tokens, seg = batch["tokens"][r], batch["segment_ids"][r]
    prev, pos = 0, 0
    for i in range(seq_len):  # naive reference of positions / targets / masks
      if seg[i] != prev:
        pos = 0
        assert seg[i] in (prev + 1, 0)
      expect_pos = pos if seg[i] else 0
      assert batch["positions"][r, i] == expect_pos
      same_next = i + 1 < seq_len and seg[i] != 0 and seg[i + 1] == seg[i]
      if same_next:
        assert batch["targets"][r, i] == tokens[i + 1]
      is_pad_tok = tokens[i] == tok.image_pad_id
      expect_mask = same_next and not is_pad_tok and tokens[i + 1] != tok.image_pad_id
      assert batch["loss_mask"][r, i] == expect_mask
      assert batch["image_mask"][r, i] == (is_pad_tok and seg[i] != 0)
      prev, pos = seg[i], pos + 1
    if seg[-1] == 0:
      assert (tokens[seg == 0] == tok.pad_id).all()
    n = int(batch["image_count"][r])
    assert (batch["image_starts"][r, n:] == -1).all()
    assert (batch["image_mask"][r].sum() ==
            sum(int(h) * int(w) for h, w in batch["image_cells"][r, :n]))
    for k in range(n):
      s = int(batch["image_starts"][r, k])
      h, w = batch["image_cells"][r, k]
      assert tokens[s - 1] == tok.image_begin_id and tokens[s + h * w] == tok.image_end_id
      assert (tokens[s:s + h * w] == tok.image_pad_id).all()
      assert seg[s - 1] == seg[s + h * w]  # one span, one segment: never split
      assert batch["images"][r, k, :h * 42, :w * 42].any()


def test_batch_layout(corpus_dir, small_tok):
  cfg = make_data(corpus_dir)
  it = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  batches = take(it, 6)
  b = batches[0]
  assert b["tokens"].shape == (4, 128) and b["tokens"].dtype == np.int32
  assert b["images"].shape == (4, 2, 168, 168, 3) and b["images"].dtype == np.uint8
  for batch in batches:
    check_row_layout(batch, small_tok, 128)
  c = it.counters()
  assert c["rows"] == 24 and c["padding_tokens"] == 0
  assert sum(int(x["image_count"].sum()) for x in batches) > 0


def test_epochs_count_passes_over_the_training_text(corpus_dir, small_tok):
  """`epochs/<stream>`: records read over the stream's records a pass. The training streams
  repeat, so the count passes 1 once every record has been read and keeps rising with the
  records read; an eval pass (test_bad_records_are_counted_not_fatal) ends at exactly 1."""
  cfg = make_data(corpus_dir)
  it = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  per_pass = it.epoch_len[it.names.index("text")]
  seen = [0.0]
  for _ in range(400):
    next(it)
    c = it.counters()
    assert c["epochs/text"] >= seen[-1]
    seen.append(c["epochs/text"])
    if c["epochs/text"] > 1.5:
      break
  assert c["epochs/text"] > 1.5, seen[-1]
  skipped = sum(v for k, v in c.items() if k.startswith("skipped/"))
  assert c["records/text"] <= c["documents/text"] + skipped
  assert c["epochs/text"] == c["records/text"] / per_pass
  assert c["documents/text"] > per_pass   # some documents were read twice
  it.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_is_bit_identical(corpus_dir, small_tok, workers):
  cfg = make_data(corpus_dir, worker_count=workers)
  it = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  take(it, 7)
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  expect = take(it, 10)
  it.close()
  fresh = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  fresh.set_state(state)
  assert_batches_equal(take(fresh, 10), expect)
  assert fresh.counters() == it.counters()
  fresh.close()


def test_resume_through_orbax_checkpoint(corpus_dir, small_tok, tmp_path):
  import grain
  import orbax.checkpoint as ocp
  cfg = make_data(corpus_dir)
  it = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  take(it, 5)
  mgr = ocp.CheckpointManager(str(tmp_path / "ckpt"),
                              options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
  mgr.save(5, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(it)))
  mgr.wait_until_finished()
  expect = take(it, 10)
  fresh = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  mgr.restore(5, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(fresh)))
  assert_batches_equal(take(fresh, 10), expect)
  mgr.close()


def eval_pass(cfg, tok, index, count):
  return list(pipeline.make_eval_iterator(cfg, index, count, tokenizer=tok))


def segment_tokens(batches):
  """Token tuples of every segment of every row."""
  out = []
  for b in batches:
    for r in range(b["tokens"].shape[0]):
      seg = b["segment_ids"][r]
      for s in range(1, int(seg.max()) + 1):
        out.append(tuple(b["tokens"][r][seg == s].tolist()))
  return out


def headers(segments, tok):
  """Text-record ids ("doc 2-17") found at the start of segments."""
  out = []
  for s in segments:
    text = tok.decode(s[1:30]) if s[0] == tok.bos_id else ""
    if text.startswith("doc "):
      out.append(text.split(":")[0])
  return out


def test_two_processes_see_disjoint_data_whose_union_is_the_whole(corpus_dir, small_tok):
  cfg = make_data(corpus_dir)
  whole = segment_tokens(eval_pass(cfg, small_tok, 0, 1))
  parts = [segment_tokens(eval_pass(cfg, small_tok, i, 2)) for i in range(2)]
  h0, h1, hall = (headers(x, small_tok) for x in (parts[0], parts[1], whole))
  assert len(hall) == 24 and len(set(hall)) == 24
  assert not set(h0) & set(h1) and sorted(h0 + h1) == sorted(hall)
  tok_count = lambda segs: collections.Counter(t for s in segs for t in s)
  assert tok_count(parts[0]) + tok_count(parts[1]) == tok_count(whole)
  assert tok_count(parts[0]) and tok_count(parts[1])


def test_train_shards_are_disjoint(corpus_dir, small_tok):
  cfg = make_data(corpus_dir)
  seen = []
  for i in range(2):
    it = pipeline.make_train_iterator(cfg, i, 2, tokenizer=small_tok)
    seen.append(set(headers(segment_tokens(take(it, 8)), small_tok)))
  assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_worker_processes_do_not_change_the_batches_and_exit_on_close(corpus_dir, small_tok):
  """Two workers a stream give the main process's batches; on close every worker exits by itself
  (exit code 0). grain's own close joins a worker for 25 s and then kills it (exit code -9), which
  it had to whenever the worker was writing an element into its queue (`pipeline.close_stream`)."""
  plain = take(pipeline.make_train_iterator(make_data(corpus_dir), tokenizer=small_tok), 8)
  it = pipeline.make_train_iterator(make_data(corpus_dir, worker_count=2), tokenizer=small_tok)
  assert_batches_equal(take(it, 8), plain)
  module = pipeline._grain_workers()
  if module is None:  # another grain: close_stream falls back to grain's own close
    it.close()
    pytest.skip("grain's worker iterator module moved: pipeline.close_stream uses grain's close")
  processes = [w._prefetch_process for s in it.streams
               for w in pipeline._worker_iterators(s, module.ProcessPrefetchDatasetIterator)]
  assert processes and all(p is not None for p in processes)
  it.close()
  assert [p.exitcode for p in processes] == [0] * len(processes)


def test_eval_pass_conserves_every_token(corpus_dir, small_tok):
  cfg = make_data(corpus_dir)
  batches = eval_pass(cfg, small_tok, 0, 1)
  got = collections.Counter(t for s in segment_tokens(batches) for t in s)
  expect = collections.Counter()
  for name in ("text.jsonl", "mm.jsonl"):
    with open(os.path.join(corpus_dir, "eval", name), "rb") as f:
      for line in f.read().splitlines():
        segs = records.parse_record(("json", line, None))
        expect.update(documents.build_document(segs, small_tok, 168).tokens.tolist())
  assert got == expect
  last = batches[-1]
  assert all(b["tokens"].shape == (4, 128) for b in batches)
  assert (last["segment_ids"].max(axis=1) >= 0).all()


def test_bad_records_are_counted_not_fatal(tmp_path, corpus_dir, small_tok):
  good_text = text_records(5, 6)
  good_mm = [mm_record(i) for i in range(6)]
  bad_text = ['{"text": "unterminated', "", '{"text": ""}', b'{"text": "\xff\xfe"}', '[]']
  empty_png = {"segments": [{"text": "empty"}, {"image_base64": ""}]}
  junk_png = {"segments": [{"image_base64": base64.b64encode(b"junk bytes").decode()}]}
  missing = {"segments": [{"image": "no_such.png"}, {"text": "gone"}]}
  tpath = tmp_path / "text.jsonl"
  with open(tpath, "wb") as f:
    for r in good_text[:3] + bad_text + good_text[3:]:
      r = r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
      f.write(r + b"\n")
  mpath = write_jsonl(tmp_path / "mm.jsonl", [empty_png] + good_mm[:3] + [junk_png, missing] +
                      good_mm[3:])
  cfg = make_data(corpus_dir, text_eval_sources=(str(tpath),), multimodal_eval_sources=(mpath,))
  it = pipeline.make_eval_iterator(cfg, tokenizer=small_tok)
  list(it)
  c = it.counters()
  skipped = {k.split("/")[1]: v for k, v in c.items() if k.startswith("skipped/")}
  assert skipped == {"malformed_json": 1, "empty_text": 2, "invalid_utf8": 1,
                     "malformed_record": 1, "image_empty": 1, "image_undecodable": 1,
                     "image_missing": 1}
  assert c["documents/text"] == 6 and c["documents/multimodal"] == 6
  # one pass of an eval set reads every record once, skipped ones included
  assert c["epochs/text"] == 1.0 and c["epochs/multimodal"] == 1.0


def test_a_stream_with_only_bad_records_stops_with_a_clear_error(tmp_path, corpus_dir, small_tok):
  bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops"] * 5)
  cfg = make_data(corpus_dir, multimodal_sources=(bad,))
  it = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  with pytest.raises(RuntimeError, match="multimodal.*skipped"):
    take(it, 20)


def test_configuration_errors_name_the_culprit(tmp_path, corpus_dir, small_tok):
  missing = str(tmp_path / "missing.jsonl")
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    pipeline.make_train_iterator(make_data(corpus_dir, text_sources=(missing,)),
                                 tokenizer=small_tok)
  (tmp_path / "shard.tfrecord").write_bytes(b"")
  with pytest.raises(ValueError, match="shard.tfrecord"):
    pipeline.make_train_iterator(
        make_data(corpus_dir, text_sources=(str(tmp_path / "shard.tfrecord"),)),
        tokenizer=small_tok)
  for w in (0.0, -2.0):
    with pytest.raises(ValueError, match="text_weight"):
      pipeline.make_train_iterator(make_data(corpus_dir, text_weight=w), tokenizer=small_tok)
  empty = write_jsonl(tmp_path / "empty.jsonl", [])
  with pytest.raises(ValueError, match="no records"):
    pipeline.make_train_iterator(make_data(corpus_dir, multimodal_sources=(empty,)),
                                 tokenizer=small_tok)
  with pytest.raises(ValueError, match="text_eval_sources and data.multimodal_eval_sources are "
                     "empty"):
    pipeline.make_eval_iterator(make_data(corpus_dir, text_eval_sources=(),
                                          multimodal_eval_sources=()), tokenizer=small_tok)
  with pytest.raises(TypeError, match="takes a DataConfig"):
    pipeline.make_train_iterator(make_cfg(corpus_dir), tokenizer=small_tok)
  with pytest.raises(ValueError, match="max_image_size"):
    pipeline.make_train_iterator(make_data(corpus_dir, seq_len=16), tokenizer=small_tok)


def test_default_corpus_with_trained_bpe(tmp_path):
  """No sources, no tokenizer: the stdlib + shapes corpus and a BPE trained into the cache."""
  from data.config import DataConfig
  data = DataConfig(cache_dir=str(tmp_path), image_docs_train=500)
  tok = pipeline.make_tokenizer(data, 300)
  assert tok.vocab_size == 300 and os.path.dirname(tok.source) == str(tmp_path / "tokenizers")
  assert len(os.listdir(tmp_path / "corpus")) == 1  # the manifest, beside the tokenizer
  it = pipeline.make_train_iterator(data, tokenizer=tok, vocab_size=300)
  batches = take(it, 60)
  c = it.counters()
  assert c["padding_tokens"] == 0 and c["documents/text"] > 0 and c["documents/multimodal"] > 0
  share = c["row_tokens/multimodal"] / (c["row_tokens/multimodal"] + c["row_tokens/text"])
  assert 0.1 < share < 0.15  # 480 rows of 128; the first rows lag while the pool fills
  check_row_layout(batches[-1], tok, 128)
  with pytest.raises(ValueError, match="vocab_size"):
    pipeline.make_train_iterator(data, tokenizer=tok, vocab_size=200)


def test_skip_locations_are_distinct_over_passes_and_streams(tmp_path, corpus_dir, small_tok):
  """Both training streams read one shard with a malformed line through several passes: the
  skip is counted each time it is read, its location listed once (issue 33: data_report
  repeated it per stream and per pass)."""
  shard = write_jsonl(tmp_path / "both.jsonl",
                      text_records(4, 3, rng_words=(3, 20)) + ["{not json"])
  cfg = make_data(corpus_dir, text_sources=(shard,), multimodal_sources=(shard,))
  it = pipeline.make_train_iterator(cfg, tokenizer=small_tok)
  for _ in range(6):
    next(it)
  assert it.counters()["skipped/malformed_json"] >= 4
  assert it.skip_locations() == {"malformed_json": [f"{shard}:4"]}


def test_text_only_sources_need_no_multimodal_source(corpus_dir, small_tok):
  """Text sources alone (no multimodal train or eval source): rows of text only, the mixture's
  whole share on the one stream, exact resume, and a held-out pass over the text records."""
  data = make_data(corpus_dir, multimodal_sources=(), multimodal_eval_sources=())
  it = pipeline.make_train_iterator(data, tokenizer=small_tok)
  first = take(it, 3)
  state = it.get_state()
  rest = take(it, 3)
  c = it.counters()
  assert c["documents/text"] > 0 and c["row_tokens/text"] > 0
  assert not any("multimodal" in k for k in c)
  for batch in first + rest:
    check_row_layout(batch, small_tok, 128)
    assert not batch["image_mask"].any() and not batch["image_count"].any()
  fresh = pipeline.make_train_iterator(data, tokenizer=small_tok)
  fresh.set_state(state)
  assert_batches_equal(take(fresh, 3), rest)
  ev = pipeline.make_eval_iterator(data, tokenizer=small_tok)
  list(ev)
  assert ev.counters()["documents/text"] == 24 and "documents/multimodal" not in ev.counters()
