"""Image embeddings onto their placeholder spans in the LM input (docs/design.md §15.2;
the packed-row layout of `data/packing.py`).

A packed row holds up to M images. Image m has `image_cells[m] = (h, w)` cells and its span of
h·w `<|image_pad|>` tokens starts at row index `image_starts[m]`; the first `image_count` slots are
used. The projector gives each image Gc² embeddings on its cell grid (cell (i, j) at Gc·i + j).
Token t of the row takes

  m  = the used slot with start_m ≤ t < start_m + h_m·w_m,   q = t − start_m,
  e_t = proj[m, Gc·(q div w_m) + (q mod w_m)]          (cells in row-major order, as in the span)

and every other token keeps its token embedding. Written as a gather per token (no scatter), so a
row only reads its own images and the batch axis shards freely.

`check_image_batch` is the host-side guard the loader runs before a batch reaches the model: a row
whose placeholders disagree with its images is an error naming the row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def span_slot(image_cells_BxMx2: jax.Array, image_starts_BxM: jax.Array,
              image_count_B: jax.Array, seq_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per token: (inside an image span [B, T] bool, its slot m [B, T], its index q in the span)."""
  B, M = image_starts_BxM.shape
  t = jnp.arange(seq_len)[None, :, None]                                 # [1, T, 1]
  start = image_starts_BxM[:, None, :]                                   # [B, 1, M]
  n_tok = (image_cells_BxMx2[..., 0] * image_cells_BxMx2[..., 1])[:, None, :]
  used = (jnp.arange(M)[None, :] < image_count_B[:, None])[:, None, :]
  inside_BxTxM = used & (t >= start) & (t < start + n_tok)
  slot = jnp.argmax(inside_BxTxM, axis=-1)
  q = jnp.arange(seq_len)[None, :] - jnp.take_along_axis(image_starts_BxM, slot, axis=1)
  return inside_BxTxM.any(-1), slot, q


def merge_image_embeddings(h_BxTxD: jax.Array, img_BxMxCxD: jax.Array,
                           image_cells_BxMx2: jax.Array, image_starts_BxM: jax.Array,
                           image_count_B: jax.Array) -> jax.Array:
  """Token embeddings with each image span replaced by its image's cell embeddings, in order.

  `img_BxMxCxD` holds each slot's Gc² = C projector outputs on the Gc×Gc cell grid.
  """
  B, T, D = h_BxTxD.shape
  M, C = img_BxMxCxD.shape[1:3]
  gc = int(round(C ** 0.5))
  inside, slot, q = span_slot(image_cells_BxMx2, image_starts_BxM, image_count_B, T)
  w = jnp.maximum(jnp.take_along_axis(image_cells_BxMx2[..., 1], slot, axis=1), 1)
  cell = gc * (q // w) + q % w
  idx = jnp.where(inside, slot * C + cell, 0)
  picked = jnp.take_along_axis(img_BxMxCxD.reshape(B, M * C, D), idx[..., None], axis=1)
  return jnp.where(inside[..., None], picked.astype(h_BxTxD.dtype), h_BxTxD)


IMAGE_KEYS = ("images", "image_count", "image_cells", "image_starts")


def check_image_batch(batch: dict, *, cell_px: int, max_image_size: int) -> None:
  """Raise ValueError if the batch's images cannot be placed (host side, numpy).

  The model takes images exactly as `data/images.py` emits them: RGB (channel rule: 1 channel is
  replicated, 3 converted, RGBA composited over white / CMYK converted, anything else rejected
  there), on a square canvas of whole `cell_px` cells no larger than `max_image_size`, each image
  of (h, w) cells with 1 ≤ h, w ≤ canvas / cell_px. Per row: `image_count` ≤ M, unused slots have
  start −1, every span lies inside the row without overlapping another, and the placeholder
  tokens (`image_mask`) are exactly the spans.
  """
  missing = [k for k in IMAGE_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch carries images but lacks {missing}")
  images = np.asarray(batch["images"])
  if images.ndim != 5:
    raise ValueError(f"images must be [B, M, P, P, C] (got shape {images.shape})")
  B, M, P, Q, C = images.shape
  if C != 3:
    raise ValueError(f"images have {C} channels; the model takes RGB (3). Convert with the channel "
                     "rule of data/images.py (1 → replicated, 4 → composited/converted, others "
                     "rejected)")
  if P != Q or P % cell_px or P > max_image_size:
    raise ValueError(f"image canvas {P}×{Q} must be square, a multiple of {cell_px} px and at most "
                     f"vision.max_image_size={max_image_size}; size images with data/images.py")
  if images.dtype != np.uint8:
    raise ValueError(f"images must be uint8 pixels (got {images.dtype})")
  count = np.asarray(batch["image_count"]).reshape(B)
  cells = np.asarray(batch["image_cells"]).reshape(B, M, 2)
  starts = np.asarray(batch["image_starts"]).reshape(B, M)
  mask = np.asarray(batch["image_mask"]).astype(bool)
  T = mask.shape[1]
  limit = P // cell_px
  for b in range(B):
    n = int(count[b])
    if not 0 <= n <= M:
      raise ValueError(f"row {b}: image_count {n} is outside [0, {M}]")
    if (starts[b, n:] != -1).any():
      raise ValueError(f"row {b}: image slots beyond image_count {n} have span starts "
                       f"{starts[b, n:].tolist()} (expected -1)")
    spans = np.zeros(T, np.int32)
    for m in range(n):
      h, w = (int(v) for v in cells[b, m])
      s = int(starts[b, m])
      if not (1 <= h <= limit and 1 <= w <= limit):
        raise ValueError(f"row {b}: image {m} has {h}×{w} cells; each side must lie in "
                         f"[1, {limit}] for a {P}-px canvas")
      if s < 0 or s + h * w > T:
        raise ValueError(f"row {b}: image {m} span [{s}, {s + h * w}) lies outside the row of "
                         f"{T} tokens")
      spans[s:s + h * w] += 1
    if (spans > 1).any():
      raise ValueError(f"row {b}: image spans overlap at tokens {np.flatnonzero(spans > 1)[:8].tolist()}")
    if not np.array_equal(spans == 1, mask[b]):
      raise ValueError(
          f"row {b}: {int(mask[b].sum())} placeholder tokens do not match its {n} images "
          f"(cells {cells[b, :n].tolist()} need {int(spans.sum())} tokens at starts "
          f"{starts[b, :n].tolist()})")
