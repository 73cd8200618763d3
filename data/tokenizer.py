"""Tokenizer: a Hugging Face `tokenizer.json`, or a byte-level BPE trained once on the default
corpus and cached (docs/design.md §T3).

Special tokens (always present; `TokenizerHandle` exposes their ids):

| token | role |
|---|---|
| `<|pad|>` | padding (id 0 in a trained BPE) |
| `<|begin_of_text|>` | first token of every document |
| `<|end_of_text|>` | last token of every document |
| `<|image_begin|>`, `<|image_end|>` | around each image's span |
| `<|image_pad|>` | placeholder, one per vision token of an image |

A user's tokenizer that lacks some of them gets them appended to its vocabulary. The cached BPE
lives in `<cache_dir>/tokenizers/bpe-v<vocab>-<manifest hash>.json`; training is deterministic
for a fixed corpus, so a different corpus (another Python version's stdlib) gets its own file.
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD = "<|pad|>"
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IMAGE_BEGIN = "<|image_begin|>"
IMAGE_END = "<|image_end|>"
IMAGE_PAD = "<|image_pad|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IMAGE_BEGIN, IMAGE_END, IMAGE_PAD)
ENCODE_CHUNK = 1 << 18  # characters per call in `encode_prefix` (a long text's chunks)


class TokenizerHandle:
  """A `tokenizers.Tokenizer` with the project's special-token ids; picklable (for workers)."""

  def __init__(self, tokenizer: Tokenizer, source: str):
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
      tokenizer.add_special_tokens(missing)
    # Text that spells a special token ("<|image_pad|>" in a source file) stays text: only the
    # pipeline places special tokens, so image spans and document ends cannot be forged.
    tokenizer.encode_special_tokens = True
    self._tok = tokenizer
    self.source = source
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    self.pad_id = ids[PAD]
    self.bos_id = ids[BOS]
    self.eos_id = ids[EOS]
    self.image_begin_id = ids[IMAGE_BEGIN]
    self.image_end_id = ids[IMAGE_END]
    self.image_pad_id = ids[IMAGE_PAD]
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def special_ids(self) -> dict[str, int]:
    return {t: self._tok.token_to_id(t) for t in SPECIAL_TOKENS}

  def id_to_token(self, i: int) -> str | None:
    """The vocabulary string of id `i` as stored (byte-level BPE pieces in their byte alphabet,
    e.g. 'Ġthe'), or None for an unused id; `decode([i])` gives the text instead."""
    return self._tok.id_to_token(int(i))

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` (no special tokens added), int32."""
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_prefix(self, text: str, max_tokens: int) -> tuple[np.ndarray, bool]:
    """The first `max_tokens` token ids of `text`, and whether they are all of them.

    A text that cannot exceed the limit (no more UTF-8 bytes than `max_tokens`: a token covers at
    least one byte) is encoded whole, exactly as `encode`. A longer one is encoded in chunks of
    at most `ENCODE_CHUNK` characters, each ending after a line break (else a space) where one is
    near, until the limit is reached: memory and time follow the kept part, not the text. The
    chunk edges may tokenize differently from the whole text (a space run split in two)."""
    if len(text) <= max_tokens // 4 or len(text.encode("utf-8")) <= max_tokens:
      ids = self.encode(text)
      return ids[:max_tokens], len(ids) <= max_tokens
    chunk = min(ENCODE_CHUNK, max(1024, 4 * max_tokens))
    parts, n, pos = [], 0, 0
    while pos < len(text) and n < max_tokens:
      end = min(len(text), pos + chunk)
      if end < len(text):  # cut after the window's last line break, else before its last space
        base = pos + chunk // 2
        window = text[base:end]
        nl, sp = window.rfind("\n"), window.rfind(" ")
        end = base + nl + 1 if nl >= 0 else (base + sp if sp > 0 else end)
      parts.append(self.encode(text[pos:end]))
      n += len(parts[-1])
      pos = end
    ids = np.concatenate(parts)
    return ids[:max_tokens], pos >= len(text) and len(ids) <= max_tokens

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def save(self, path: str) -> None:
    """Write the tokenizer, special tokens included, as a `tokenizer.json` (`load_tokenizer`)."""
    self._tok.save(path)

  def __getstate__(self):
    return {"json": self._tok.to_str(), "source": self.source}

  def __setstate__(self, state):
    self.__init__(Tokenizer.from_str(state["json"]), state["source"])


def load_tokenizer(path: str) -> TokenizerHandle:
  """A Hugging Face `tokenizer.json` (e.g. a DeepSeek tokenizer), special tokens ensured."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
  try:
    tokenizer = Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises a plain Exception for a file it cannot parse
    raise ValueError(f"tokenizer file {path!r} is not a Hugging Face tokenizer.json ({e})") from None
  return TokenizerHandle(tokenizer, source=path)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """A byte-level BPE with the special tokens first (PAD = 0), `vocab_size` entries in all."""
  if vocab_size < 256 + len(SPECIAL_TOKENS):
    raise ValueError(f"vocab_size={vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} specials")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  return tok


def cached_bpe(texts_fn, vocab_size: int, corpus_hash: str, cache_dir: str) -> TokenizerHandle:
  """The BPE for (corpus, vocab_size) from the cache, training and storing it on a miss.

  `texts_fn()` yields the training texts; it is only called on a miss.
  """
  folder = os.path.join(cache_dir, "tokenizers")
  path = os.path.join(folder, f"bpe-v{vocab_size}-{corpus_hash[:16]}.json")
  if not os.path.isfile(path):
    tok = train_bpe(texts_fn(), vocab_size)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, path)  # atomic: concurrent trainers write the same bytes
  return TokenizerHandle(Tokenizer.from_file(path), source=path)
