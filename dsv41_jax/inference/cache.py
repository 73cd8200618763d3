"""The decode caches in their stored formats (docs/design.md §9.2, §10; layout in `cache_layout`).

Per KV-source (Full) layer, the global compressed KV, one row per entry g (tokens [g·m, (g+1)·m)):

  main_BxNxD2     uint8          main KV, E2M1 codes packed two per byte (channel 2i low nibble)
  main_scale_BxNxS float8_e4m3fn one E4M3 scale per 16 channels (S = D/16)
  index_BxNxI2    uint8          indexer K, E2M1 codes packed two per byte
  index_scale_BxNxR uint8        one E8M0 (power-of-two exponent) scale per 32 channels (R = I/32)
  pending_BxmxD   compute dtype  the compressor inputs of the group still filling (m rows; the
                                 group's entry is written when its m-th token arrives)

Per layer, the SWA ring buffer of the last `sliding_window` keys (K = V):

  codes_BxWxD     float8_e4m3fn  E4M3 elements
  scales_BxWxR    uint8          one E8M0 scale per 32 channels
  pos_W           int32          the position a slot holds (−1 = empty); key p sits in slot p mod W

A code-and-scale pair decodes to exactly the value of the matching fake quantizer of
`dsv41_jax.quant` (`fp4_main_kv`, `mxfp4`, `fp8_swa`): `encode_*` runs the same arithmetic and
keeps the codes instead of multiplying them back. Bytes per token of the global cache, measured
from these arrays (`global_bytes_per_token`), equal `cache_layout.global_kv_layout`'s figure;
`pending` and `pos_W` are per sequence, not per token, and are not counted.

`init_cache(..., stored_formats=False)` keeps instead the values the model's forward pass computes
(compute dtype; fake-quantized only where the config's QAT switches `fp4_main_kv`, `fp4_indexer`,
`fp8_swa_kv` say) with empty scale arrays: decode then equals the forward pass up to float
rounding whatever the switches, which is how it is tested. With the stored formats, decode equals
the forward pass with all three switches on, except where a rounding-level difference upstream
moves a value across a rounding boundary of its format (one code step: measured in
benchmarks/RESULTS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from pallas_kernels.ops import quant as ops_quant

_F32 = jnp.float32


# --- element codes ----------------------------------------------------------------------------

def _e2m1_codes(q: jax.Array) -> jax.Array:
  """uint8 4-bit codes (sign << 3 | magnitude index) of values on the E2M1 grid."""
  a = jnp.abs(q)
  mag = jnp.where(a < 2, a * 2, jnp.where(a < 4, a + 2, a / 2 + 4)).astype(jnp.uint8)
  return mag | (jnp.signbit(q).astype(jnp.uint8) << 3)


_E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _pack(codes: jax.Array) -> jax.Array:
  """[..., C] 4-bit codes → [..., C/2] bytes, channel 2i in the low nibble."""
  return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
  """[..., C/2] bytes → [..., C] float32 E2M1 values."""
  lo, hi = packed & 0xF, packed >> 4
  codes = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
  return jnp.asarray(_E2M1_VALUES)[codes.astype(jnp.int32)]


def _e8m0(scale_f32: jax.Array) -> jax.Array:
  """uint8 biased exponent of a power-of-two float32 scale."""
  return ((jax.lax.bitcast_convert_type(scale_f32, jnp.int32) >> 23) & 0xFF).astype(jnp.uint8)


def _from_e8m0(e: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(e.astype(jnp.int32) << 23, _F32)


def _per_block(scale_bx1: jax.Array) -> jax.Array:
  return scale_bx1[..., 0]


# --- formats: encode (codes, scales) and decode ------------------------------------------------

def encode_fp4_main_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(packed E2M1 [..., C/2] uint8, E4M3 scales [..., C/16]) of `quant.fp4_main_kv`."""
  xb = ops_quant._blocks(x, quant.FP4_MAIN_KV_BLOCK)
  scale = quant.fp4_main_kv_scale(ops_quant._block_amax(xb))
  q = quant.round_to_e2m1(jnp.clip(quant.div_short(xb, scale), -quant.E2M1_MAX, quant.E2M1_MAX))
  return _pack(_e2m1_codes(q).reshape(x.shape)), _per_block(scale).astype(jnp.float8_e4m3fn)


def decode_fp4_main_kv(packed: jax.Array, scales: jax.Array) -> jax.Array:
  q = _unpack(packed)
  blk = q.reshape(*q.shape[:-1], -1, quant.FP4_MAIN_KV_BLOCK)
  return (blk * scales.astype(_F32)[..., None]).reshape(q.shape)


def encode_mxfp4(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(packed E2M1 [..., C/2] uint8, E8M0 exponents [..., C/32] uint8) of `quant.mxfp4`."""
  xb = ops_quant._blocks(x, quant.MXFP4_BLOCK)
  amax = jnp.maximum(ops_quant._block_amax(xb), quant.E2M1_MAX * 2.0 ** -126)
  scale = ops_quant._ceil_pow2(amax / quant.E2M1_MAX)
  q = quant.round_to_e2m1(jnp.clip(xb / scale, -quant.E2M1_MAX, quant.E2M1_MAX))
  return _pack(_e2m1_codes(q).reshape(x.shape)), _e8m0(_per_block(scale))


def decode_mxfp4(packed: jax.Array, exponents: jax.Array) -> jax.Array:
  q = _unpack(packed)
  blk = q.reshape(*q.shape[:-1], -1, quant.MXFP4_BLOCK)
  return (blk * _from_e8m0(exponents)[..., None]).reshape(q.shape)


def encode_fp8_swa(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(E4M3 elements [..., C] float8_e4m3fn, E8M0 exponents [..., C/32] uint8) of `quant.fp8_swa`."""
  xb = ops_quant._blocks(x, quant.FP8_SWA_BLOCK)
  amax = jnp.maximum(ops_quant._block_amax(xb), 1e-4)
  scale = ops_quant._ceil_pow2(amax / quant.E4M3_MAX)
  q = quant.round_to_e4m3(jnp.clip(xb / scale, -quant.E4M3_MAX, quant.E4M3_MAX))
  return q.reshape(x.shape).astype(jnp.float8_e4m3fn), _e8m0(_per_block(scale))


def decode_fp8_swa(codes: jax.Array, exponents: jax.Array) -> jax.Array:
  q = codes.astype(_F32)
  blk = q.reshape(*q.shape[:-1], -1, quant.FP8_SWA_BLOCK)
  return (blk * _from_e8m0(exponents)[..., None]).reshape(q.shape)


# --- the caches -------------------------------------------------------------------------------

class GlobalCache(NamedTuple):
  """One KV-source layer's compressed entries (module docstring)."""

  main_BxNxD2: jax.Array
  main_scale_BxNxS: jax.Array
  index_BxNxI2: jax.Array
  index_scale_BxNxR: jax.Array
  pending_BxmxD: jax.Array


class SWACache(NamedTuple):
  """One layer's ring buffer of window keys (module docstring)."""

  codes_BxWxD: jax.Array
  scales_BxWxR: jax.Array
  pos_W: jax.Array


class DecodeCache(NamedTuple):
  """Everything a decode step reads and writes: SWA rings (one per layer, in layer order) and
  the global caches (keyed by KV-source layer id)."""

  swa: tuple[SWACache, ...]
  glob: dict[int, GlobalCache]


def capacity(cfg: ModelConfig, max_len: int) -> int:
  """Tokens a cache of `max_len` holds: rounded up to a whole number of groups of every ratio."""
  lcm = int(np.lcm.reduce([m for m in cfg.compress_ratios if m] or [1]))
  return -(-max_len // lcm) * lcm


def fits_stored_formats(cfg: ModelConfig) -> str | None:
  """None when the stored formats' blocks tile the vectors, else why not."""
  if cfg.head_dim % quant.FP8_SWA_BLOCK or cfg.index_head_dim % quant.MXFP4_BLOCK:
    return (f"the stored cache formats need head_dim ({cfg.head_dim}) and index_head_dim "
            f"({cfg.index_head_dim}) to be multiples of 32 (FP8 / MXFP4 blocks)")
  return None


def init_cache(cfg: ModelConfig, batch: int, max_len: int, stored_formats: bool = True
               ) -> DecodeCache:
  """Empty caches for `batch` sequences of up to `max_len` tokens (see `capacity`); with
  `stored_formats=False` the forward pass's values instead of codes (module docstring)."""
  if stored_formats and (reason := fits_stored_formats(cfg)):
    raise ValueError(reason)
  plan = build_layer_plan(cfg)
  L = capacity(cfg, max_len)
  D, I, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
  dt = jnp.dtype(cfg.dtype)
  z = jnp.zeros
  glob = {}
  for spec in plan:
    if spec.owns_compressor:
      m = spec.compress_ratio
      n = L // m
      if stored_formats:
        arrays = (z((batch, n, D // 2), jnp.uint8),
                  z((batch, n, D // quant.FP4_MAIN_KV_BLOCK), jnp.float8_e4m3fn),
                  z((batch, n, I // 2), jnp.uint8), z((batch, n, I // quant.MXFP4_BLOCK), jnp.uint8))
      else:
        arrays = (z((batch, n, D), dt), z((batch, n, 0), jnp.float8_e4m3fn), z((batch, n, I), dt),
                  z((batch, n, 0), jnp.uint8))
      glob[spec.index] = GlobalCache(*arrays, z((batch, m, cfg.hidden_size), dt))
  if stored_formats:
    ring = lambda: (z((batch, W, D), jnp.float8_e4m3fn),
                    z((batch, W, D // quant.FP8_SWA_BLOCK), jnp.uint8))
  else:
    ring = lambda: (z((batch, W, D), dt), z((batch, W, 0), jnp.uint8))
  swa = tuple(SWACache(*ring(), jnp.full((W,), -1, jnp.int32)) for _ in plan)
  return DecodeCache(swa, glob)


# --- writing and reading, in either layout ------------------------------------------------------

def entry_arrays(cfg: ModelConfig, g: GlobalCache, main: jax.Array, key: jax.Array
                 ) -> tuple[jax.Array, ...]:
  """The four stored arrays of entries with main KV `main` and indexer key `key` (unquantized)."""
  if g.main_BxNxD2.dtype == jnp.uint8:
    return (*encode_fp4_main_kv(main), *encode_mxfp4(key))
  dt = g.main_BxNxD2.dtype
  main = quant.fp4_main_kv(main) if cfg.fp4_main_kv else main
  key = quant.mxfp4(key) if cfg.fp4_indexer else key
  return (main.astype(dt), g.main_scale_BxNxS[:, :main.shape[1]], key.astype(dt),
          g.index_scale_BxNxR[:, :key.shape[1]])


def read_main(main, scales) -> jax.Array:
  return decode_fp4_main_kv(main, scales) if main.dtype == jnp.uint8 else main


def read_index(g: GlobalCache) -> jax.Array:
  if g.index_BxNxI2.dtype == jnp.uint8:
    return decode_mxfp4(g.index_BxNxI2, g.index_scale_BxNxR)
  return g.index_BxNxI2


def key_arrays(cfg: ModelConfig, ring: SWACache, key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The ring's two arrays for SWA keys `key` [B, T, D] (unquantized)."""
  if ring.codes_BxWxD.dtype == jnp.float8_e4m3fn:
    return encode_fp8_swa(key.astype(_F32))
  B, T = key.shape[:2]
  key = quant.fp8_swa(key) if cfg.fp8_swa_kv else key
  return key.astype(ring.codes_BxWxD.dtype), jnp.zeros((B, T, 0), jnp.uint8)


def read_keys(codes, scales) -> jax.Array:
  return decode_fp8_swa(codes, scales) if codes.dtype == jnp.float8_e4m3fn else codes


def global_bytes_per_token(cache: DecodeCache, max_len: int) -> float:
  """Bytes of the stored global entries (codes + scales, all KV-source layers) per sequence token,
  from the arrays themselves: Σ nbytes / (batch · capacity)."""
  stored = sum(a.nbytes for g in cache.glob.values() for a in g[:4])
  batch = next(iter(cache.glob.values())).main_BxNxD2.shape[0]
  return stored / (batch * max_len)


def swa_bytes_per_sequence(cache: DecodeCache) -> int:
  """Bytes of the SWA rings (codes + scales, every layer) per sequence."""
  batch = cache.swa[0].codes_BxWxD.shape[0]
  return sum(s.codes_BxWxD.nbytes + s.scales_BxWxR.nbytes for s in cache.swa) // batch
