"""Host-side preparation of a packed batch for the model: Engram hash rows (docs/design.md §7.2, §14).

Hashing needs int64 arithmetic, which jnp does not do without x64, so it runs in numpy on the host
for every batch, once per Engram layer.
"""

from __future__ import annotations

import functools

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram import compression, hashing


@functools.lru_cache(maxsize=None)
def _hash_params(cfg: ModelConfig, layer_id: int, pad_id: int | None) -> hashing.EngramHashParams:
  return hashing.engram_hash_params(cfg, layer_id, pad_id)


def engram_ids(cfg: ModelConfig, tokens_BxT: np.ndarray, segment_ids_BxT: np.ndarray,
               image_mask_BxT: np.ndarray | None = None,
               compression_map: np.ndarray | None = None) -> dict[int, np.ndarray]:
  """Per Engram layer, int32 [B, T, n_orders·n_heads] table rows.

  `compression_map` maps token ids to canonical ids (`engram.compression`); without one the ids
  are used as they are, which requires vocab_size ≤ engram_compressed_vocab_size.
  """
  tokens = np.asarray(tokens_BxT)
  if compression_map is None:
    if cfg.vocab_size > cfg.engram_compressed_vocab_size:
      raise ValueError(
          f"vocab_size ({cfg.vocab_size}) exceeds engram_compressed_vocab_size "
          f"({cfg.engram_compressed_vocab_size}): pass the tokenizer's compression map")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
      bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)].flat[0]
      raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {cfg.vocab_size})")
    canonical = tokens.astype(np.int64)
    pad_id = None
  else:
    canonical = compression.compress_token_ids(tokens, compression_map)
    # The pad id is the canonical id of the pad token (docs/design.md §7.1: `map[pad]`).
    pad_id = int(compression_map[cfg.engram_pad_token_id])
  return {l: hashing.engram_hash_ids(canonical, segment_ids_BxT, image_mask_BxT,
                                     _hash_params(cfg, l, pad_id))
          for l in cfg.engram_layer_ids}
