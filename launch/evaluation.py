"""Held-out evaluation: mean loss (nats per target token) and bits per byte.

    bits_per_byte = Σ_targets loss_nats / ln 2  ÷  Σ_targets UTF-8 bytes of the target token

Bytes come from each token's own byte string: for a byte-level BPE the vocabulary string is
mapped back through the byte-level alphabet; special tokens and image placeholders count 0 bytes
(they are never loss targets anyway).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import numpy as np


def _byte_level_decoder() -> dict[str, int]:
  # The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onward.
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars = dict((b, chr(b)) for b in printable)
  n = 0
  for b in range(256):
    if b not in chars:
      chars[b] = chr(256 + n)
      n += 1
  return {c: b for b, c in chars.items()}


def token_byte_lengths(tok, vocab_size: int) -> np.ndarray:
  """int32 [vocab_size]: UTF-8 bytes each token stands for (0 for special / unused ids)."""
  alphabet = _byte_level_decoder()
  special = set(tok.special_ids.values())
  out = np.zeros((vocab_size,), np.int32)
  for i in range(min(vocab_size, tok.vocab_size)):
    if i in special:
      continue
    piece = tok.id_to_token(i)
    if piece is None:
      continue
    if all(c in alphabet for c in piece):
      out[i] = len(piece)
    else:
      out[i] = len(tok.decode([i]).encode("utf-8"))
  return out


def evaluate(eval_fn: Callable, batches: Iterator, max_batches: int) -> dict[str, float]:
  """Run `eval_fn(batch) -> (sum_nats, n_tokens, n_bytes)` over up to `max_batches` batches."""
  nats = tokens = n_bytes = 0.0
  for i, batch in enumerate(batches):
    if max_batches and i >= max_batches:
      break
    s, n, b = eval_fn(batch)
    nats, tokens, n_bytes = nats + float(s), tokens + float(n), n_bytes + float(b)
  if hasattr(batches, "close"):
    batches.close()
  return {"loss": nats / max(tokens, 1.0), "bits_per_byte": nats / math.log(2) / max(n_bytes, 1.0),
          "tokens": tokens}
