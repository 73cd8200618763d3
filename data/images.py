"""Image decoding and sizing for the vision pathway (TRAINING.md §3).

The rule every image goes through (`load_image`):

1. Decode with Pillow. Zero bytes -> skipped as `image_empty`; bytes Pillow cannot decode (or a
   path that cannot be read) -> skipped as `image_undecodable` / `image_missing`.
2. Channels. Palette images are expanded first. 1 channel (`1`, `L`) is replicated to RGB;
   3 channels (`RGB`, `YCbCr`, `LAB`, `HSV`) are converted to RGB; 4 channels: `RGBA`/`RGBa` are
   composited over white, `CMYK` is converted to RGB. Every other layout -- 2 channels (`LA`,
   `La`, `PA`) and 1-channel modes deeper than 8 bits (`I`, `I;16`, `F`) -- is rejected as
   `image_channels`, since guessing a display mapping for them would feed the model invented
   pixels.
3. Size. The image is scaled (aspect kept) to fit a `max_image_size` box if it is larger; each side
   then becomes a whole number of 42-px cells (patch 14 x unshuffle 3): `cells = round(side / 42)`,
   at least 1 (so an image smaller than 42 px is upscaled to one cell) and at most
   `max_image_size // 42`. The pixels are resampled (bicubic) to exactly `cells * 42`.

The vision pathway turns an image of `h_cells x w_cells` cells into exactly `h_cells * w_cells`
tokens, which is the length of the placeholder span `documents.py` reserves for it.
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

CELL_PX = 42  # ViT patch 14 x pixel-unshuffle 3

_THREE_BAND = ("RGB", "YCbCr", "LAB", "HSV")
_FOUR_BAND_ALPHA = ("RGBA", "RGBa")


class ImageRejected(ValueError):
  """An image the rule above refuses; `reason` is the counter it is recorded under."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = reason


def max_cells(max_image_size: int) -> int:
  """Cells per side of the largest image (`max_image_size // 42`, at least 1)."""
  if max_image_size < CELL_PX:
    raise ValueError(f"data.max_image_size={max_image_size} is below one {CELL_PX}-px cell")
  return max_image_size // CELL_PX


def cells_for(height: int, width: int, max_image_size: int) -> tuple[int, int]:
  """(h_cells, w_cells) of an image of the given size under the sizing rule (step 3)."""
  limit = max_cells(max_image_size)
  scale = min(1.0, max_image_size / max(height, width))
  h_cells = min(limit, max(1, int(round(height * scale / CELL_PX))))
  w_cells = min(limit, max(1, int(round(width * scale / CELL_PX))))
  return h_cells, w_cells


def to_rgb(img: Image.Image) -> Image.Image:
  """Channel rule (step 2): an RGB image, or ImageRejected('image_channels')."""
  if img.mode in ("P", "PA"):
    img = img.convert("RGBA" if img.mode == "PA" or "transparency" in img.info else "RGB")
  if img.mode in ("1", "L"):
    return img.convert("RGB")
  if img.mode == "RGB":
    return img
  if img.mode in _THREE_BAND:
    return img.convert("RGB")
  if img.mode in _FOUR_BAND_ALPHA:
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
  if img.mode == "CMYK":
    return img.convert("RGB")
  raise ImageRejected("image_channels", f"mode {img.mode} ({len(img.getbands())} bands)")


def decode(data: bytes) -> Image.Image:
  """Pillow image from encoded bytes (step 1)."""
  if len(data) == 0:
    raise ImageRejected("image_empty")
  try:
    img = Image.open(io.BytesIO(data))
    img.load()
  except Exception as e:  # Pillow raises many types for corrupt data
    raise ImageRejected("image_undecodable", f"{type(e).__name__}: {e}") from None
  if img.width == 0 or img.height == 0:
    raise ImageRejected("image_empty", "zero-sized image")
  return img


def read_path(path: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise ImageRejected("image_missing", f"{path}: {e.strerror}") from None


def load_image(data: bytes | None, path: str | None, max_image_size: int) -> np.ndarray:
  """Decode, convert and size one image: uint8 [h_cells*42, w_cells*42, 3]."""
  if data is None:
    data = read_path(path) if path is not None else b""
  img = to_rgb(decode(data))
  h_cells, w_cells = cells_for(img.height, img.width, max_image_size)
  size = (w_cells * CELL_PX, h_cells * CELL_PX)
  if img.size != size:
    img = img.resize(size, Image.Resampling.BICUBIC)
  return np.asarray(img, dtype=np.uint8)


def resolve(path: str, base_dir: str | None) -> str:
  """An image path from a record, relative paths taken from the shard's directory."""
  if base_dir and not os.path.isabs(path):
    return os.path.join(base_dir, path)
  return path
