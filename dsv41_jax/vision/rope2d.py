"""2-D rotary position embedding of the ViT (docs/design.md §15.1: 2D-RoPE replaces absolute
positional embeddings, so any resolution works).

A head vector of C channels is split in two halves. The first half is rotated by the patch's row r,
the second by its column c, each half as interleaved channel pairs (2i, 2i+1) with the 1-D RoPE of
`dsv41_jax.layers.rope` and the inverse frequencies

  ω_i = θ^(−2i / (C/2)),  i = 0 .. C/4 − 1.

For a query at (r₁, c₁) and a key at (r₂, c₂) every rotated pair contributes
  Re[(q̃ · conj k̃) e^{i ω (r₁ − r₂)}]  (first half)   and   Re[(q̃ · conj k̃) e^{i ω (c₁ − c₂)}]  (second),
so the attention score depends on the patches' positions only through the offset (r₁ − r₂, c₁ − c₂).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.layers.rope import apply_rope, rope_inv_freq


def rope2d_inv_freq(head_dim: int, theta: float) -> np.ndarray:
  """ω [head_dim // 4] (float64): the plain RoPE frequencies of one half of the head."""
  if head_dim % 4:
    raise ValueError(f"2-D RoPE needs head_dim divisible by 4 (got {head_dim})")
  return rope_inv_freq(head_dim // 2, theta)


def apply_rope2d(x: jax.Array, rows: jax.Array, cols: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotate x [..., S, H, C] by patch rows / cols [..., S]: first C/2 channels by the row, the rest
  by the column. Math in float32, result in x's dtype."""
  half = x.shape[-1] // 2
  if half != 2 * len(inv_freq):
    raise ValueError(f"head_dim {x.shape[-1]} does not match {len(inv_freq)} 2-D RoPE frequencies")
  return jnp.concatenate([apply_rope(x[..., :half], rows, inv_freq),
                          apply_rope(x[..., half:], cols, inv_freq)], axis=-1)


def grid_positions(grid_h: int, grid_w: int) -> tuple[np.ndarray, np.ndarray]:
  """(rows, cols) int32 [grid_h · grid_w] of a patch grid flattened row-major."""
  r, c = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
  return r.reshape(-1).astype(np.int32), c.reshape(-1).astype(np.int32)
