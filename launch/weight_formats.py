"""Storage formats of the released checkpoint: FP8 block weights, FP4 experts, FP8 table rows
(docs/checkpoints.md §Storage formats).

| format     | elements                  | one scale (E8M0, a power of two) per  | used for            |
|------------|---------------------------|---------------------------------------|---------------------|
| `fp8`      | E4M3                      | tile of `block` = 32 × 32 (out × in)  | dense linear weights |
| `fp8_rows` | E4M3                      | 1 × 32 (32 columns of one row)        | Engram tables       |
| `fp4`      | E2M1, two per int8 byte   | 1 × 32 (32 inputs of one output row)  | routed experts      |

Encoding uses the project's own rules (`dsv41_jax.quant`, docs/design.md §9.2): the scale is
`quant.pow2_scale` of the block amax (E4M3 with floor 1e-4, the `fp8_swa` rule; E2M1 with floor
6·2^-126, the `mxfp4` rule) and the elements are rounded by `quant.round_to_e4m3` /
`quant.round_to_e2m1`. The scale rounds up, so a value that already is `q·s` for a coarser or
equal scale decodes to itself: decode ∘ encode is the identity on values the format holds.
FP4 nibbles: the lower-indexed element in the low nibble; bit 3 the sign, bits 0-2 the index into
{0, 0.5, 1, 1.5, 2, 3, 4, 6}; −0 is kept (code 8). Partial tiles at the edges of a weight whose
sides are not multiples of the tile get their own scale (the scale grid is the ceiling).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax import quant

FP8_TILE = (32, 32)      # the release's quantization_config.weight_block_size
ROW_BLOCK = (1, 32)      # Engram table rows: one scale per 32 columns
FP4_BLOCK = quant.MXFP4_BLOCK

E2M1_GRID = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


class FormatError(ValueError):
  """Values or shapes a storage format cannot take; the message names the tensor."""


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
  """The scale tensor's shape for a [rows, cols] tensor in blocks of `block` (ceiling)."""
  return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def e8m0(scale_f32: np.ndarray) -> np.ndarray:
  """Powers of two as E8M0 bytes (exact)."""
  return np.asarray(scale_f32, np.float32).astype(ml_dtypes.float8_e8m0fnu)


def _scale_values(scale: np.ndarray, name: str) -> np.ndarray:
  """float32 scales from E8M0 or float storage; NaN (E8M0 0xFF) or a non-positive scale fails."""
  s = np.asarray(scale).astype(np.float32)
  if not np.all(np.isfinite(s) & (s > 0)):
    raise FormatError(f"{name}: the scale holds NaN, infinite or non-positive entries")
  return s


@functools.partial(jax.jit, static_argnames="element")
def _quantize_blocks(xb_NxB: jax.Array, element: str) -> tuple[jax.Array, jax.Array]:
  """(elements on the grid [N, B], power-of-two scales [N]) of N blocks of B values."""
  amax = jnp.max(jnp.abs(xb_NxB), axis=-1)
  if element == "e4m3":
    scale = quant.pow2_scale(amax, quant.E4M3_MAX, quant.FP8_AMAX_FLOOR)
    q = quant.round_to_e4m3(jnp.clip(xb_NxB / scale[:, None], -quant.E4M3_MAX, quant.E4M3_MAX))
  else:
    scale = quant.pow2_scale(amax, quant.E2M1_MAX, quant.MXFP4_AMAX_FLOOR)
    q = quant.round_to_e2m1(jnp.clip(xb_NxB / scale[:, None], -quant.E2M1_MAX, quant.E2M1_MAX))
  return q, scale


def _quantized(xb_NxB: np.ndarray, element: str) -> tuple[np.ndarray, np.ndarray]:
  """`_quantize_blocks` with N padded to a power of two, so few programs are compiled."""
  n = xb_NxB.shape[0]
  bucket = max(8, 1 << (n - 1).bit_length())
  padded = np.zeros((bucket, xb_NxB.shape[1]), np.float32)
  padded[:n] = xb_NxB
  q, scale = _quantize_blocks(padded, element)
  return np.asarray(q)[:n], np.asarray(scale)[:n]


def encode_fp8(x: np.ndarray, block: tuple[int, int] = FP8_TILE) -> tuple[np.ndarray, np.ndarray]:
  """(E4M3 elements [R, C], E8M0 scales [⌈R/br⌉, ⌈C/bc⌉]) of a float [R, C] tensor."""
  R, C = x.shape
  (gr, gc), (br, bc) = scale_grid((R, C), block), block
  padded = np.zeros((gr * br, gc * bc), np.float32)   # zeros leave every amax as it is
  padded[:R, :C] = x
  blocks = padded.reshape(gr, br, gc, bc).transpose(0, 2, 1, 3).reshape(gr * gc, br * bc)
  q, scale = _quantized(blocks, "e4m3")
  q = q.reshape(gr, gc, br, bc).transpose(0, 2, 1, 3).reshape(gr * br, gc * bc)[:R, :C]
  return q.astype(ml_dtypes.float8_e4m3fn), e8m0(scale.reshape(gr, gc))


def decode_fp8(q: np.ndarray, scale: np.ndarray, name: str,
               block: tuple[int, int] = FP8_TILE) -> np.ndarray:
  """float32 q·s of E4M3 elements [R, C] and their scales (E8M0 or float) per `block` tile."""
  R, C = q.shape
  if tuple(scale.shape) != scale_grid((R, C), block):
    raise FormatError(f"{name}: scale shape {list(scale.shape)} does not tile the weight "
                      f"{[R, C]} in blocks of {list(block)} (expected "
                      f"{list(scale_grid((R, C), block))})")
  s = _scale_values(scale, name)
  full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:R, :C]
  return np.asarray(q).astype(np.float32) * full


def encode_fp4(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
  """(packed int8 [R, C/2], E8M0 scales [R, C/32]) of a float [R, C] tensor (C a multiple of 32)."""
  R, C = x.shape
  if C % FP4_BLOCK:
    raise FormatError(f"{name}: FP4 needs the input width ({C}) to be a multiple of {FP4_BLOCK}")
  q, scale = _quantized(np.asarray(x, np.float32).reshape(-1, FP4_BLOCK), "e2m1")
  q = q.reshape(R, C)
  index = np.searchsorted(E2M1_GRID, np.abs(q)).astype(np.uint8)   # exact grid values
  codes = index | (np.signbit(q).astype(np.uint8) << 3)
  packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
  return packed.view(np.int8), e8m0(scale.reshape(R, C // FP4_BLOCK))


def decode_fp4(packed: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
  """float32 [R, 2·P] of packed E2M1 pairs [R, P] (int8 or uint8) and scales [R, 2·P/32]."""
  R, P = packed.shape
  C = 2 * P
  if C % FP4_BLOCK or tuple(scale.shape) != (R, C // FP4_BLOCK):
    raise FormatError(f"{name}: scale shape {list(scale.shape)} does not fit the packed FP4 "
                      f"weight {[R, P]} (expected {[R, C // FP4_BLOCK]}: one scale per "
                      f"{FP4_BLOCK} inputs)")
  b = np.asarray(packed).view(np.uint8)
  codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(R, C)
  values = np.where(codes & 8, -1.0, 1.0).astype(np.float32) * E2M1_GRID[codes & 7]
  s = _scale_values(scale, name)
  return values * np.repeat(s, FP4_BLOCK, axis=1)
