"""Low-precision formats, as the model reads them, and the stored sizes of their layouts (docs/design.md §9, §10).

The format math (E2M1 / E4M3 grids, the FP4 main-KV, MXFP4 and FP8 SWA block formats and the
straight-through `fake_quant`) is the op module `pallas_kernels.ops.quant`; it is re-exported
here because the cache layouts and the Engram FP8 table read the same functions and constants.
The model's layers reach the straight-through quantizers through the dispatcher
(`pallas_kernels.dispatch.call("fake_quant_…", x, policy=cfg.ops.…)`), which picks the op's
reference or its fused kernel.

The byte-size helpers give the stored size of one vector in each layout (docs/design.md §10): the
element bits plus one scale byte per block.
"""

from __future__ import annotations

from pallas_kernels.ops.quant import (  # noqa: F401  (the model's names for the op's formats)
    E2M1_MAX, E4M3_MAX, E4M3_MIN_SUBNORMAL, FP4_MAIN_KV_BLOCK, FP8_AMAX_FLOOR, FP8_SWA_BLOCK,
    MXFP4_AMAX_FLOOR, MXFP4_BLOCK, div_short, fake_quant, fp4_main_kv, fp4_main_kv_scale, fp8_swa,
    mxfp4, pow2_scale, round_to_e2m1, round_to_e4m3)


# --- stored sizes (docs/design.md §10) -----------------------------------------------------------


def _whole_blocks(n_channels: int, block: int) -> int:
  if n_channels <= 0 or n_channels % block:
    raise ValueError(f"{n_channels} channels do not fill whole blocks of {block}")
  return n_channels // block


def fp4_e4m3_16_bytes(n_channels: int) -> int:
  """Bytes of one vector in the main-KV layout: 4 bits per element + one E4M3 byte per 16."""
  return n_channels // 2 + _whole_blocks(n_channels, FP4_MAIN_KV_BLOCK)


def mxfp4_bytes(n_channels: int) -> int:
  """Bytes of one vector in MXFP4: 4 bits per element + one E8M0 byte per 32."""
  return n_channels // 2 + _whole_blocks(n_channels, MXFP4_BLOCK)


def fp8_32_bytes(n_channels: int) -> int:
  """Bytes of one vector in the SWA FP8 layout: 1 byte per element + one E8M0 byte per 32."""
  return n_channels + _whole_blocks(n_channels, FP8_SWA_BLOCK)
