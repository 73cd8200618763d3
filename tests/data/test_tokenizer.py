"""Tests of data/tokenizer.py: special tokens, round trip, user tokenizers, the BPE cache."""

import os
import pickle

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from data import tokenizer
from tests.data.conftest import random_text


def test_special_ids_exposed_and_distinct(small_tok):
  ids = small_tok.special_ids
  assert set(ids) == set(tokenizer.SPECIAL_TOKENS)
  assert len(set(ids.values())) == len(ids)
  assert small_tok.pad_id == 0  # trained BPE: specials first
  assert (small_tok.bos_id, small_tok.eos_id, small_tok.image_begin_id, small_tok.image_end_id,
          small_tok.image_pad_id) == tuple(ids[t] for t in tokenizer.SPECIAL_TOKENS[1:])
  assert small_tok.vocab_size == 320


def test_round_trip(small_tok):
  rng = np.random.default_rng(0)
  for text in [random_text(rng, 30), "unicode: héllo ✓ 中文\n\ttabs", "<|image_pad|> literal"]:
    ids = small_tok.encode(text)
    assert ids.dtype == np.int32
    assert small_tok.decode(ids) == text


def test_text_never_becomes_a_special_token(small_tok):
  for name in small_tok.special_ids:
    ids = small_tok.encode(f"x {name} y")
    assert not set(ids.tolist()) & set(small_tok.special_ids.values())
    assert small_tok.decode(ids) == f"x {name} y"


def test_pickle_keeps_behaviour(small_tok):
  clone = pickle.loads(pickle.dumps(small_tok))
  text = "pickled tokenizers encode the same"
  np.testing.assert_array_equal(clone.encode(text), small_tok.encode(text))
  assert clone.special_ids == small_tok.special_ids


def test_save_then_load_keeps_behaviour(small_tok, tmp_path):
  path = str(tmp_path / "tokenizer.json")
  small_tok.save(path)
  loaded = tokenizer.load_tokenizer(path)
  text = "saved tokenizers encode the same <|image_pad|>"
  np.testing.assert_array_equal(loaded.encode(text), small_tok.encode(text))
  assert loaded.special_ids == small_tok.special_ids and loaded.vocab_size == small_tok.vocab_size


def test_user_tokenizer_gets_missing_specials(tmp_path):
  vocab = {chr(c): i for i, c in enumerate(range(97, 123))}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  handle = tokenizer.load_tokenizer(path)
  assert handle.vocab_size == 26 + len(tokenizer.SPECIAL_TOKENS)
  assert sorted(handle.special_ids.values()) == list(range(26, 32))
  np.testing.assert_array_equal(handle.encode("abc"), [0, 1, 2])


def test_bpe_cache_trains_once(tmp_path):
  calls = []

  def texts():
    calls.append(1)
    rng = np.random.default_rng(1)
    return [random_text(rng, 100) for _ in range(20)]

  a = tokenizer.cached_bpe(texts, 300, "ab" * 32, str(tmp_path))
  b = tokenizer.cached_bpe(texts, 300, "ab" * 32, str(tmp_path))
  assert len(calls) == 1 and a.source == b.source and os.path.isfile(a.source)
  c = tokenizer.cached_bpe(texts, 300, "cd" * 32, str(tmp_path))  # another corpus: own file
  assert len(calls) == 2 and c.source != a.source
  assert a.vocab_size == 300
