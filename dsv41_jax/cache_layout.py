"""Inference-cache layout: what each compressed entry and each SWA key stores (docs/design.md §9–§10).

Global cache: only CSA2 Full layers (KV sources) store entries; Reuse and Reindex layers read them.
Each entry holds the main KV (all `head_dim` channels, FP4 E2M1 with one E4M3 scale per 16) and the
indexer key (`index_head_dim` channels, MXFP4: E2M1 with one power-of-two E8M0 scale per 32).
SWA cache: every layer keeps its last `sliding_window` keys (K = V), FP8 E4M3 with one E8M0 scale
per 32 channels. Byte counts per format come from `dsv41_jax.quant`.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan


@dataclasses.dataclass(frozen=True)
class GlobalKVLayout:
  main_kv_bytes: int            # per entry
  index_k_bytes: int            # per entry
  entries_per_token: Fraction   # Σ over KV-source layers of 1/m

  @property
  def bytes_per_entry(self) -> int:
    return self.main_kv_bytes + self.index_k_bytes

  @property
  def bytes_per_token(self) -> float:
    value = self.entries_per_token * self.bytes_per_entry
    return int(value) if value.denominator == 1 else float(value)


def global_kv_layout(cfg: ModelConfig) -> GlobalKVLayout:
  plan = build_layer_plan(cfg)
  entries = sum((Fraction(1, l.compress_ratio) for l in plan if l.owns_compressor), Fraction(0))
  return GlobalKVLayout(main_kv_bytes=quant.fp4_e4m3_16_bytes(cfg.head_dim),
                        index_k_bytes=quant.mxfp4_bytes(cfg.index_head_dim),
                        entries_per_token=entries)


def swa_kv_bytes_per_sequence(cfg: ModelConfig) -> int:
  """Window keys × FP8 bytes per key × layers (every layer keeps its own SWA cache)."""
  return cfg.sliding_window * quant.fp8_32_bytes(cfg.head_dim) * cfg.num_hidden_layers
