"""Tokenizer compression for Engram: token id → canonical (compressed) id (docs/design.md §7.1).

Each token is decoded and keyed by its normalised text; tokens with equal keys share a compressed
id, numbered in first-seen order of token id:
  key = raw token string                                  if the decoded text contains U+FFFD
      = NFKC → NFD → drop marks → lowercase (per character) → collapse [ \\t\\r\\n]+ to " "
        → strip whitespace (a text normalised to exactly " " stays " ")
      = the decoded text                                     if that normal form is empty
The compressed pad id is `map[engram_pad_token_id]`.

Two implementations of the normalisation exist on purpose: `normalize_token_text` (standard library,
Unicode tables of the running Python) and `tokenizers_normalizer()` (the same chain in the Rust
`tokenizers` normalisers, which is what the reference implementation runs). They agree except on
~1,300 rare code points whose Unicode properties changed between the two Unicode versions (marks
and letters added after Unicode 14); `cached_compression_map`, the production path, uses the Rust
chain so the map matches the released one.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from typing import Callable

import numpy as np

REPLACEMENT_CHAR = "\ufffd"
_WS_RUN = re.compile(r"[ \t\r\n]+")
# Unicode White_Space characters (what the Rust tokenizers' Strip() removes; Python's str.strip()
# would also remove U+001C..U+001F).
_WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
                "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def normalize_token_text(text: str) -> str:
  """The normalised form of a decoded token (may be empty); no U+FFFD handling here."""
  s = unicodedata.normalize("NFKC", text)
  s = unicodedata.normalize("NFD", s)
  s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))
  # Character by character, as the Rust normaliser does: no final-sigma context rule.
  s = _WS_RUN.sub(" ", "".join(c.lower() for c in s))
  return s if s == " " else s.strip(_WHITE_SPACE)


def tokenizers_normalizer():
  """The §7.1 chain as a Rust `tokenizers` normaliser; call `.normalize_str(text)`.

  A private-use sentinel carries a lone " " through Strip(), as in the reference implementation.
  """
  from tokenizers import Regex, normalizers  # lazy: optional dependency of this package

  sentinel = "\ue000"
  return normalizers.Sequence([
      normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
      normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
      normalizers.Replace(Regex(r"^ $"), sentinel),
      normalizers.Strip(),
      normalizers.Replace(sentinel, " "),
  ])


def compression_key(decoded: str, raw_token: str,
                    normalize: Callable[[str], str] = normalize_token_text) -> str:
  """Key of one token (docs/design.md §7.1 steps 2–3)."""
  if REPLACEMENT_CHAR in decoded:
    return raw_token
  key = normalize(decoded)
  return key if key else decoded


def build_compression_map(decode: Callable[[int], str], vocab_size: int, *,
                          raw_token: Callable[[int], str],
                          normalize: Callable[[str], str] = normalize_token_text) -> np.ndarray:
  """int64 [vocab_size]: compressed id of each token id 0..vocab_size−1.

  decode(i) is the text of token i alone (special tokens kept); raw_token(i) its vocabulary string,
  the key of tokens whose text holds U+FFFD (partial UTF-8 sequences). `normalize` is step 3's
  chain (see the module docstring for the two implementations).
  """
  key_to_id: dict[str, int] = {}
  out = np.empty((int(vocab_size),), dtype=np.int64)
  for i in range(int(vocab_size)):
    key = compression_key(decode(i), raw_token(i), normalize)
    out[i] = key_to_id.setdefault(key, len(key_to_id))
  return out


def compress_token_ids(token_ids: np.ndarray, compression_map: np.ndarray) -> np.ndarray:
  """int64 array of compressed ids; raises ValueError naming an id outside the vocabulary."""
  ids = np.asarray(token_ids)
  if not np.issubdtype(ids.dtype, np.integer):
    raise TypeError(f"token ids must be integers, got dtype {ids.dtype}")
  bad = (ids < 0) | (ids >= compression_map.shape[0])
  if bad.any():
    first = int(ids[bad].reshape(-1)[0])
    raise ValueError(f"token id {first} is outside the tokenizer vocabulary "
                     f"[0, {compression_map.shape[0]}) ({int(bad.sum())} such ids in the batch)")
  return compression_map[ids]


def cached_compression_map(tokenizer_json_path: str, cache_dir: str,
                           vocab_size: int | None = None) -> np.ndarray:
  """`build_compression_map` for a `tokenizers` JSON file, cached as .npy under cache_dir.

  The cache key hashes the tokenizer file, the vocabulary size and this module's rules version, so
  a changed tokenizer never reuses a stale map. vocab_size defaults to the tokenizer's size with
  added tokens.
  """
  from tokenizers import Tokenizer  # lazy: the package imports only jax/flax/optax/numpy

  with open(tokenizer_json_path, "rb") as f:
    blob = f.read()
  tok = Tokenizer.from_str(blob.decode("utf-8"))
  n = tok.get_vocab_size(with_added_tokens=True) if vocab_size is None else int(vocab_size)
  digest = hashlib.sha256(blob + f"|{n}|rules-v2".encode()).hexdigest()[:24]
  path = os.path.join(cache_dir, f"engram_compression_{digest}.npy")
  if os.path.exists(path):
    return np.load(path)

  def raw_token(i: int) -> str:
    s = tok.id_to_token(i)
    if s is None:
      raise ValueError(f"token id {i} is outside the tokenizer vocabulary (size "
                       f"{tok.get_vocab_size(with_added_tokens=True)})")
    return s

  table = build_compression_map(lambda i: tok.decode([i], skip_special_tokens=False), n,
                                raw_token=raw_token,
                                normalize=tokenizers_normalizer().normalize_str)
  os.makedirs(cache_dir, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp.npy"
  np.save(tmp, table)
  os.replace(tmp, path)
  return table
