"""Image decoding and sizing for the vision pathway (docs/design.md §T3).

The rule every image goes through (`load_image`):

1. Decode with Pillow. Zero bytes -> skipped as `image_empty`; bytes Pillow cannot decode (or a
   path that cannot be read) -> skipped as `image_undecodable` / `image_missing`. Before any
   pixel is decoded, the header's size is checked: more than `max_pixels` (`data.max_image_pixels`)
   -> skipped as `image_too_large`, so a 32-KB PNG claiming 121 Mpx costs no memory; an image file
   larger than `max_file_bytes` (`data.max_record_bytes`) is not even read.
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
import warnings

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


MAX_PIXELS = 50_000_000  # the default of data.max_image_pixels (data/config.py)
MAX_FILE_BYTES = 64 * 2**20  # the default of data.max_record_bytes


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
  """Pillow image from encoded bytes (step 1); the pixel bound is checked on the header alone."""
  if len(data) == 0:
    raise ImageRejected("image_empty")
  try:
    with warnings.catch_warnings():  # our own bound below replaces Pillow's bomb warning
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)
      img = Image.open(io.BytesIO(data))  # lazy: reads the header only
  except Image.DecompressionBombError as e:
    raise ImageRejected("image_too_large", str(e)) from None
  except Exception as e:  # Pillow raises many types for corrupt data
    raise ImageRejected("image_undecodable", f"{type(e).__name__}: {e}") from None
  if img.width * img.height > max_pixels:
    raise ImageRejected("image_too_large", f"{img.width} x {img.height} px, more than "
                        f"data.max_image_pixels={max_pixels}")
  try:
    img.load()
  except Exception as e:
    raise ImageRejected("image_undecodable", f"{type(e).__name__}: {e}") from None
  if img.width == 0 or img.height == 0:
    raise ImageRejected("image_empty", "zero-sized image")
  return img


def read_path(path: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
  """An image file's bytes; `image_too_large` past `max_bytes` (read no further than that)."""
  try:
    with open(path, "rb") as f:
      data = f.read(max_bytes + 1)
  except OSError as e:
    raise ImageRejected("image_missing", f"{path}: {e.strerror}") from None
  if len(data) > max_bytes:
    raise ImageRejected("image_too_large", f"{path}: file larger than "
                        f"data.max_record_bytes={max_bytes}")
  return data


def load_image(data: bytes | None, path: str | None, max_image_size: int,
               max_pixels: int = MAX_PIXELS, max_file_bytes: int = MAX_FILE_BYTES) -> np.ndarray:
  """Decode, convert and size one image: uint8 [h_cells*42, w_cells*42, 3]."""
  if data is None:
    data = read_path(path, max_file_bytes) if path is not None else b""
  img = to_rgb(decode(data, max_pixels))
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
