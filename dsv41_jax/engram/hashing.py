"""Multi-head n-gram hashing of compressed token ids (docs/design.md §7.2, packing rule of §14).

Runs on the host in numpy: the hash XORs int64 products (wrapping on overflow) and reduces them
modulo primes near 16M, which jnp cannot do without x64. The training loop calls
`engram_hash_ids` once per batch and Engram layer and feeds the int32 row ids to the model.

Per Engram layer ℓ (`EngramHashParams`):
  mult_k   = 2·r_k + 1,  r = default_rng(10007·ℓ).integers(0, ⌊(2^63−1)/V_c⌋ // 2, size=max_ngram)
  p_{n,h}  = distinct primes, searched upward from engram_vocab_size − 1 over all layers, orders
             n = 2..max_ngram and heads h in that order, each excluding every prime used before
  offset   = cumulative row offset of (n, h) in the flat order-major list of the layer
  τ_k(t)   = compressed id at t − k, or the pad id if t − k < 0, if t − k lies in another document
             (segment), or if any token in [t − k, t] is dead (image-span token)
  row(t,n,h) = ((⊕_{k<n} τ_k(t)·mult_k) mod p_{n,h}) + offset_{n,h}
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# Deterministic Miller–Rabin witnesses: correct for every n < 3.3·10^24 (covers int64).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
  """Deterministic Miller–Rabin primality test for 0 ≤ n < 3.3·10^24."""
  n = int(n)
  if n < 2:
    return False
  for p in _MR_BASES:
    if n % p == 0:
      return n == p
  d, s = n - 1, 0
  while d % 2 == 0:
    d //= 2
    s += 1
  for a in _MR_BASES:
    x = pow(a, d, n)
    if x in (1, n - 1):
      continue
    for _ in range(s - 1):
      x = x * x % n
      if x == n - 1:
        break
    else:
      return False
  return True


def _next_unused_prime(after: int, used: set[int]) -> int:
  candidate = after + 1
  while not (is_prime(candidate) and candidate not in used):
    candidate += 1
  return candidate


@functools.lru_cache(maxsize=32)
def engram_table_sizes(vocab_size_start: int, layer_ids: tuple[int, ...], max_ngram_size: int,
                       n_heads: int) -> dict[int, tuple[tuple[int, ...], ...]]:
  """Prime sub-table sizes: {layer_id: ((p_{2,0}, ..., p_{2,H-1}), (p_{3,0}, ...), ...)}.

  For each layer in order, each order n = 2..max_ngram_size and each head, the next prime after
  the search start (vocab_size_start − 1, restarted per order) not used by any earlier
  (layer, order, head). All sizes are therefore distinct.
  """
  if vocab_size_start <= 0:
    raise ValueError(f"engram_vocab_size (the prime search start) must be positive, got "
                     f"{vocab_size_start}")
  used: set[int] = set()
  sizes: dict[int, tuple[tuple[int, ...], ...]] = {}
  for layer_id in layer_ids:
    per_order = []
    for _ in range(2, max_ngram_size + 1):
      start, heads = vocab_size_start - 1, []
      for _ in range(n_heads):
        p = _next_unused_prime(start, used)
        used.add(p)
        heads.append(p)
        start = p
      per_order.append(tuple(heads))
    sizes[int(layer_id)] = tuple(per_order)
  return sizes


@dataclasses.dataclass(frozen=True)
class EngramHashParams:
  """Hash constants of one Engram layer (docs/design.md §7.2); all arrays are int64 numpy.

  multipliers: [max_ngram_size] odd multipliers mult_k.
  primes:      [n_orders, n_heads] sub-table sizes p_{n,h} (order-major).
  offsets:     [n_orders, n_heads] first global row of each sub-table in the layer's table.
  pad_id:      compressed id that replaces look-back tokens that are unavailable.
  """

  layer_id: int
  multipliers: np.ndarray
  primes: np.ndarray
  offsets: np.ndarray
  pad_id: int

  @property
  def max_ngram_size(self) -> int:
    return int(self.multipliers.shape[0])

  @property
  def num_rows(self) -> int:
    """True number of table rows of the layer (sum of its primes)."""
    return int(self.primes.sum())

  @property
  def num_hash_heads(self) -> int:
    """Row ids per token: n_orders · n_heads."""
    return int(self.primes.size)


def engram_multipliers(layer_id: int, compressed_vocab_size: int,
                       max_ngram_size: int) -> np.ndarray:
  """mult = 2·r + 1 with r ~ default_rng(10007·layer_id).integers(0, ⌊(2^63−1)/V_c⌋ // 2)."""
  half_bound = max(1, (np.iinfo(np.int64).max // int(compressed_vocab_size)) // 2)
  rng = np.random.default_rng(10007 * int(layer_id))
  r = rng.integers(0, half_bound, size=(max_ngram_size,), dtype=np.int64)
  return r * 2 + 1


def engram_hash_params(cfg, layer_id: int, pad_id: int | None = None) -> EngramHashParams:
  """Hash constants of Engram layer `layer_id` of ModelConfig `cfg`.

  `pad_id` is the compressed pad id, `compression_map[cfg.engram_pad_token_id]` (docs/design.md §7.1);
  without it `cfg.engram_pad_token_id` is used as is (right when token ids are not compressed).
  """
  if layer_id not in cfg.engram_layer_ids:
    raise ValueError(f"layer {layer_id} is not an Engram layer (engram_layer_ids "
                     f"{list(cfg.engram_layer_ids)})")
  sizes = engram_table_sizes(cfg.engram_vocab_size, cfg.engram_layer_ids,
                             cfg.engram_max_ngram_size, cfg.engram_n_heads)[int(layer_id)]
  primes = np.asarray(sizes, dtype=np.int64)
  flat = primes.reshape(-1)
  offsets = (np.cumsum(flat) - flat).reshape(primes.shape)
  return EngramHashParams(
      layer_id=int(layer_id),
      multipliers=engram_multipliers(layer_id, cfg.engram_compressed_vocab_size,
                                     cfg.engram_max_ngram_size),
      primes=primes, offsets=offsets,
      pad_id=int(cfg.engram_pad_token_id if pad_id is None else pad_id))


def lookback_valid(segment_ids_BxT: np.ndarray, dead_mask_BxT: np.ndarray,
                   max_back: int) -> np.ndarray:
  """Bool [B, T, max_back]: token t − k may be read by the n-gram at t (k = 0..max_back−1).

  True iff t − k ≥ 0, every token of [t − k, t] is in t's document (the same run of segment id)
  and none of them is dead.
  """
  seg = np.asarray(segment_ids_BxT)
  dead = np.asarray(dead_mask_BxT, dtype=bool)
  B, T = seg.shape
  t = np.arange(T)
  # First row index of t's document: the last position ≤ t where the segment id changed.
  change = np.ones((B, T), dtype=bool)
  change[:, 1:] = seg[:, 1:] != seg[:, :-1]
  doc_start = np.maximum.accumulate(np.where(change, t, 0), axis=1)
  last_dead = np.maximum.accumulate(np.where(dead, t, -1), axis=1)
  k = np.arange(max_back)
  src = t[None, :, None] - k[None, None, :]
  return (src >= doc_start[:, :, None]) & (src > last_dead[:, :, None])


def engram_hash_ids(compressed_ids_BxT: np.ndarray, segment_ids_BxT: np.ndarray,
                    dead_mask_BxT: np.ndarray | None, params: EngramHashParams) -> np.ndarray:
  """int32 [B, T, n_orders·n_heads]: global row ids into the layer's concatenated table.

  Column j = (n − 2)·n_heads + h holds row(t, n, h) (docs/design.md §7.2), the layout the table's row
  offsets and `Engram.w_ekv` rows follow. `dead_mask_BxT` (image-span tokens) may be None.
  """
  x = np.asarray(compressed_ids_BxT, dtype=np.int64)
  if x.ndim != 2:
    raise ValueError(f"compressed ids must be [B, T], got shape {x.shape}")
  seg = np.asarray(segment_ids_BxT)
  if seg.shape != x.shape:
    raise ValueError(f"segment ids {seg.shape} and token ids {x.shape} differ in shape")
  dead = np.zeros(x.shape, bool) if dead_mask_BxT is None else np.asarray(dead_mask_BxT, bool)
  if dead.shape != x.shape:
    raise ValueError(f"dead mask {dead.shape} and token ids {x.shape} differ in shape")
  if params.num_rows >= 2**31:
    raise ValueError(f"layer {params.layer_id} has {params.num_rows} rows: int32 ids overflow")
  max_n = params.max_ngram_size
  valid = lookback_valid(seg, dead, max_n)
  T = x.shape[1]
  out = []
  mix = None
  with np.errstate(over="ignore"):
    for k in range(max_n):
      shifted = np.full_like(x, params.pad_id)
      shifted[:, k:] = x[:, :T - k]
      tau = np.where(valid[:, :, k], shifted, params.pad_id)
      term = tau * params.multipliers[k]          # int64 product, wraps on overflow
      mix = term if mix is None else np.bitwise_xor(mix, term)
      if k >= 1:                                  # the order-(k+1) n-gram is complete
        n_idx = k - 1
        for h in range(params.primes.shape[1]):
          row = np.mod(mix, params.primes[n_idx, h]) + params.offsets[n_idx, h]
          out.append(row)
  return np.stack(out, axis=-1).astype(np.int32)


def batch_rows_touched(hash_ids_BxTxH: np.ndarray, token_mask_BxT: np.ndarray) -> int:
  """Distinct table rows read by the real tokens of a whole batch (for logging table coverage)."""
  ids = np.asarray(hash_ids_BxTxH)
  return int(np.unique(ids[np.asarray(token_mask_BxT, bool)]).size)
