"""Engram n-gram hashing (dsv41_jax/engram/hashing.py) against a token-by-token reference."""

import numpy as np
import pytest

from configs import common, tiny
from dsv41_jax import testing
from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.engram import hashing


def _primes_from(start: int, count: int) -> list[int]:
  """The first `count` primes ≥ start, by a sieve window (independent of Miller–Rabin)."""
  width = 64 * count + 2000
  small = [p for p in range(2, int(np.sqrt(start + width)) + 2)
           if all(p % q for q in range(2, int(p**0.5) + 1))]
  ok = np.ones(width, bool)
  for p in small:
    first = (-start) % p
    ok[first::p] = False
    if start <= p < start + width:
      ok[p - start] = True
  found = [start + int(i) for i in np.flatnonzero(ok)]
  assert len(found) >= count
  return found[:count]


def _to_int64(v: int) -> int:
  v &= (1 << 64) - 1
  return v - (1 << 64) if v >= 1 << 63 else v


def _reference_hash(x, seg, dead, p: hashing.EngramHashParams):
  """Plain loops over tokens, orders, heads with Python integers (int64 wrap done by hand)."""
  B, T = x.shape
  n_orders, n_heads = p.primes.shape
  out = np.zeros((B, T, n_orders * n_heads), np.int64)
  for b in range(B):
    for t in range(T):
      taus = []
      for k in range(p.max_ngram_size):
        s = t - k
        ok = s >= 0 and all(seg[b, j] == seg[b, t] and not dead[b, j] for j in range(s, t + 1))
        taus.append(int(x[b, s]) if ok else p.pad_id)
      for oi, n in enumerate(range(2, p.max_ngram_size + 1)):
        mix = 0
        for k in range(n):
          mix ^= _to_int64(taus[k] * int(p.multipliers[k]))
        for h in range(n_heads):
          out[b, t, oi * n_heads + h] = mix % int(p.primes[oi, h]) + int(p.offsets[oi, h])
  return out


def _packed_batch(rng, B, T, vocab):
  """Packed rows (documents, trailing padding, image spans) from `testing.packed_batch`, plus
  a dead span at a row start and scattered dead tokens."""
  cfg = testing.tiny_config(vocab_size=vocab, seq_len=T, engram_layer_ids=())
  b = testing.packed_batch(cfg, rng, batch_size=B, max_docs=4, image_spans=2)
  dead = b["image_mask"].copy()
  dead[1, 0:2] = True                  # a span at the row start
  dead |= rng.random((B, T)) < 0.05
  return b["tokens"], b["segment_ids"], dead


def test_hash_ids_match_loop_reference():
  cfg = common.model_config(tiny.get_config())
  rng = np.random.default_rng(7)
  x, seg, dead = _packed_batch(rng, 3, 40, cfg.engram_compressed_vocab_size)
  for layer in cfg.engram_layer_ids:
    p = hashing.engram_hash_params(cfg, layer, pad_id=int(rng.integers(0, 100)))
    got = hashing.engram_hash_ids(x, seg, dead, p)
    assert got.dtype == np.int32
    assert got.shape == (3, 40, 3 * cfg.engram_n_heads)
    np.testing.assert_array_equal(got, _reference_hash(x, seg, dead, p))
    # Each id lands in its own (order, head) sub-table.
    lo = p.offsets.reshape(-1)
    assert np.all(got >= lo) and np.all(got < lo + p.primes.reshape(-1))


def test_hash_ids_at_full_size_match_reference():
  """Flash-size multipliers overflow int64 products: the wrap must match Python's."""
  cfg = ModelConfig()
  rng = np.random.default_rng(3)
  x, seg, dead = _packed_batch(rng, 2, 24, cfg.engram_compressed_vocab_size)
  p = hashing.engram_hash_params(cfg, 14, pad_id=5)
  np.testing.assert_array_equal(hashing.engram_hash_ids(x, seg, dead, p),
                                _reference_hash(x, seg, dead, p))


def test_lookback_stops_at_documents_and_dead_tokens():
  cfg = common.model_config(tiny.get_config())
  p = hashing.engram_hash_params(cfg, 1)
  rng = np.random.default_rng(0)
  x = rng.integers(0, 500, size=(1, 12))
  seg = np.array([[1] * 6 + [2] * 6])
  base = hashing.engram_hash_ids(x, seg, None, p)
  y = x.copy()
  y[0, :6] = rng.integers(0, 500, size=6)      # change the first document only
  np.testing.assert_array_equal(hashing.engram_hash_ids(y, seg, None, p)[0, 6:], base[0, 6:])
  dead = np.zeros((1, 12), bool)
  dead[0, 8] = True
  z = x.copy()
  z[0, 6:9] = rng.integers(0, 500, size=3)     # tokens before (and at) the dead token
  np.testing.assert_array_equal(hashing.engram_hash_ids(z, seg, dead, p)[0, 9:],
                                hashing.engram_hash_ids(x, seg, dead, p)[0, 9:])


def test_multipliers_are_odd_and_seeded_by_layer():
  cfg = ModelConfig()
  for layer in cfg.engram_layer_ids:
    m = hashing.engram_hash_params(cfg, layer).multipliers
    rng = np.random.default_rng(10007 * layer)
    bound = (2**63 - 1) // cfg.engram_compressed_vocab_size // 2
    np.testing.assert_array_equal(m, 2 * rng.integers(0, bound, size=4, dtype=np.int64) + 1)
    assert m.dtype == np.int64 and np.all(m % 2 == 1)


def test_flash_table_sizes_are_the_consecutive_primes_and_sum_exactly():
  cfg = ModelConfig()
  sizes = hashing.engram_table_sizes(cfg.engram_vocab_size, cfg.engram_layer_ids, 4, 8)
  flat = [p for layer in cfg.engram_layer_ids for order in sizes[layer] for p in order]
  assert len(flat) == 48 and len(set(flat)) == 48
  assert flat == _primes_from(cfg.engram_vocab_size, 48)
  assert sum(sum(o) for o in sizes[1]) == 384_006_168
  assert sum(sum(o) for o in sizes[14]) == 384_016_682
  p = hashing.engram_hash_params(cfg, 14)
  assert p.num_rows == 384_016_682
  np.testing.assert_array_equal(p.offsets.reshape(-1),
                                np.concatenate([[0], np.cumsum(p.primes.reshape(-1))[:-1]]))


def test_table_sizes_prime_and_distinct_for_tiny():
  cfg = common.model_config(tiny.get_config())
  sizes = hashing.engram_table_sizes(cfg.engram_vocab_size, cfg.engram_layer_ids,
                                     cfg.engram_max_ngram_size, cfg.engram_n_heads)
  flat = [p for layer in cfg.engram_layer_ids for order in sizes[layer] for p in order]
  assert flat == _primes_from(cfg.engram_vocab_size, len(flat))


def test_is_prime_against_sieve():
  n = 20000
  sieve = np.ones(n, bool)
  sieve[:2] = False
  for i in range(2, int(n**0.5) + 1):
    sieve[i * i::i] = False
  assert [hashing.is_prime(i) for i in range(n)] == list(sieve)
  assert hashing.is_prime(2**61 - 1) and not hashing.is_prime(3215031751)  # strong pseudoprime


def test_bad_engram_configs_rejected():
  with pytest.raises(ConfigError, match="engram_layer_ids"):
    ModelConfig(engram_layer_ids=(1, 40))
  for start in (0, -7):
    with pytest.raises(ConfigError, match="engram_vocab_size"):
      ModelConfig(engram_vocab_size=start)
  cfg = common.model_config(tiny.get_config())
  with pytest.raises(ValueError, match="not an Engram layer"):
    hashing.engram_hash_params(cfg, 2)
