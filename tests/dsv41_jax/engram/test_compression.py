"""Engram tokenizer compression (dsv41_jax/engram/compression.py), on tokenizers built here."""

import json
import os

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers

from dsv41_jax.engram import compression

SENTINEL = "\ue000"


def _reference_normalizer():
  """The rule chain of docs/design.md §7.1 expressed with the Rust `tokenizers` normalizers."""
  return normalizers.Sequence([
      normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
      normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
      normalizers.Replace(Regex(r"^ $"), SENTINEL),
      normalizers.Strip(),
      normalizers.Replace(SENTINEL, " "),
  ])


# token → the key it must get (hand-derived from the rules)
WORDS = [
    ("Hello", "hello"),
    ("hello", "hello"),
    (" héllo", "hello"),          # accent dropped, leading space stripped
    ("\t\n", " "),                # a lone whitespace run is kept as " "
    ("  ", " "),
    ("Ｈｅｌｌｏ", "hello"),       # full-width, NFKC
    ("ﬁ", "fi"),                  # ligature, NFKC
    ("FI", "fi"),
    ("\x1c", "\x1c"),             # not White_Space: Strip() keeps it (Python's str.strip would not)
    ("\u0301", "\u0301"),         # a lone mark normalises to "" → the raw text is the key
    ("\u212b", "a"),              # ANGSTROM SIGN → Å → A + ring → a
    ("a", "a"),
    ("x \t y", "x y"),
    (" new\r\nline ", "new line"),
    ("\ufffd", "\ufffd"),         # U+FFFD: the raw token string is the key
]


def _word_level_tokenizer():
  vocab = {w: i for i, (w, _) in enumerate(WORDS)}
  vocab["[UNK]"] = len(vocab)
  return Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))


def _expected_ids(keys):
  seen = {}
  return np.array([seen.setdefault(k, len(seen)) for k in keys], np.int64)


@pytest.mark.parametrize("rust", [False, True])
def test_compression_rules_on_word_level_tokenizer(rust):
  tok = _word_level_tokenizer()
  n = tok.get_vocab_size()
  kw = dict(normalize=compression.tokenizers_normalizer().normalize_str) if rust else {}
  got = compression.build_compression_map(lambda i: tok.decode([i], skip_special_tokens=False), n,
                                          raw_token=tok.id_to_token, **kw)
  keys = [k for _, k in WORDS] + ["[unk]"]
  np.testing.assert_array_equal(got, _expected_ids(keys))
  assert got.dtype == np.int64
  # Deterministic: a second build gives the same map.
  again = compression.build_compression_map(lambda i: tok.decode([i], skip_special_tokens=False),
                                            n, raw_token=tok.id_to_token)
  np.testing.assert_array_equal(got, again)


def test_partial_utf8_tokens_keep_their_raw_strings():
  """Byte-level tokens holding half of a UTF-8 character decode to U+FFFD; distinct raw tokens
  must stay distinct, whole characters normalise as text."""
  # Byte-level alphabet: 'Ã' = 0xC3, 'Â' = 0xC2, '©' = 0xA9, 'Ġ' = ' '; 'Ã©' = "é".
  vocab = {"Ã": 0, "Â": 1, "Ã©": 2, "e": 3, "ĠE": 4, "©": 5}
  tok = Tokenizer(models.BPE(vocab, merges=[]))
  tok.decoder = decoders.ByteLevel()
  decode = lambda i: tok.decode([i])
  assert decode(0) == decode(1) == decode(5) == "\ufffd"
  got = compression.build_compression_map(decode, len(vocab), raw_token=tok.id_to_token)
  np.testing.assert_array_equal(got, [0, 1, 2, 2, 2, 3])


def test_normalizer_matches_tokenizers_reference_on_random_text():
  ref = _reference_normalizer()
  rng = np.random.default_rng(11)
  pools = [" \t\r\n\x0b\x0c\x1c\x85\xa0\u2003\u3000", "AbCdÉèÖøßİǅ", "\u0301\u0308\u0327\u20dd",
           "ﬁﬂ①Ａｂ㎒ｶﾞ", "漢字かなカナ", "ΑΣΩσςДЖ", "0123.,!?"]
  alphabet = "".join(pools)
  cases = ["", " ", "  ", "\t", "\u3000", "\xa0", " a ", "\u0301", "\x1c", "\x0b"]
  cases += ["".join(rng.choice(list(alphabet), size=int(rng.integers(1, 8)))) for _ in range(3000)]
  for s in cases:
    assert compression.normalize_token_text(s) == ref.normalize_str(s), repr(s)


def test_compress_token_ids_and_out_of_vocab_error():
  table = np.array([0, 0, 1, 2, 1], np.int64)
  ids = np.array([[4, 0, 3], [2, 1, 1]])
  np.testing.assert_array_equal(compression.compress_token_ids(ids, table), table[ids])
  with pytest.raises(ValueError, match=r"token id 7 is outside"):
    compression.compress_token_ids(np.array([[1, 7, 2]]), table)
  with pytest.raises(ValueError, match=r"token id -1 is outside"):
    compression.compress_token_ids(np.array([-1, 2]), table)


def test_cached_compression_map(tmp_path):
  tok = _word_level_tokenizer()
  path = os.path.join(tmp_path, "tokenizer.json")
  tok.save(path)
  cache = os.path.join(tmp_path, "cache")
  first = compression.cached_compression_map(path, cache)
  expected = _expected_ids([k for _, k in WORDS] + ["[unk]"])
  np.testing.assert_array_equal(first, expected)
  files = os.listdir(cache)
  assert len(files) == 1 and files[0].endswith(".npy")
  np.testing.assert_array_equal(compression.cached_compression_map(path, cache), expected)
  # A vocabulary larger than the tokenizer's names the first missing id.
  with pytest.raises(ValueError, match=f"token id {len(expected)} is outside"):
    compression.cached_compression_map(path, cache, vocab_size=len(expected) + 3)
  # A changed tokenizer gets its own cache entry.
  data = json.loads(open(path).read())
  data["model"]["vocab"]["zzz"] = len(expected)
  with open(path, "w") as f:
    json.dump(data, f)
  grown = compression.cached_compression_map(path, cache)
  assert grown.shape == (len(expected) + 1,) and len(os.listdir(cache)) == 2
