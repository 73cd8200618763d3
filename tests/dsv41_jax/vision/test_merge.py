"""Image embeddings land exactly on their placeholder spans (`dsv41_jax/vision/merge.py`), on rows
laid out by the data pipeline's own `assemble_row`; malformed rows and images are refused."""

import io

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from data import images as data_images
from data.documents import Piece
from data.packing import assemble_row, stack_rows
from dsv41_jax.vision.merge import check_image_batch, merge_image_embeddings

PAD, BEGIN, END, IMG = 0, 1, 2, 3
T, M, CANVAS = 64, 3, 168   # 4 × 4 cells at most


def piece(parts, rng):
  """parts: ints (text runs) and (h, w) images -> a data Piece."""
  toks, starts, cells, pix = [], [], [], []
  for p in parts:
    if isinstance(p, int):
      toks += list(rng.integers(10, 100, p))
    else:
      h, w = p
      toks.append(BEGIN)
      starts.append(len(toks))
      toks += [IMG] * (h * w)
      toks.append(END)
      cells.append(p)
      pix.append(rng.integers(0, 256, (42 * h, 42 * w, 3)).astype(np.uint8))
  return Piece(np.asarray(toks, np.int32), np.asarray(starts, np.int32),
               np.asarray(cells, np.int32).reshape(-1, 2), pix)


def rows(rng):
  r0 = [piece([3, (1, 2), 4, (3, 1), 2], rng), piece([1, (2, 2), 3], rng)]   # 3 images, 2 docs
  r1 = [piece([2, (4, 4), 5], rng)]
  r2 = [piece([20], rng)]
  return stack_rows([assemble_row(r, T, M, CANVAS, PAD, IMG) for r in (r0, r1, r2)])


def test_image_embeddings_land_on_their_spans_in_order():
  rng = np.random.default_rng(0)
  b = rows(rng)
  check_image_batch(b, cell_px=42, max_image_size=CANVAS)
  assert list(b["image_count"]) == [3, 1, 0]
  D, gc = 6, 4
  h = rng.normal(size=(3, T, D)).astype(np.float32)
  img = rng.normal(size=(3, M, gc * gc, D)).astype(np.float32)
  got = np.asarray(merge_image_embeddings(jnp.asarray(h), jnp.asarray(img),
                                          jnp.asarray(b["image_cells"]),
                                          jnp.asarray(b["image_starts"]),
                                          jnp.asarray(b["image_count"])))
  want = h.copy()
  for r in range(3):
    for k in range(int(b["image_count"][r])):
      hh, ww = b["image_cells"][r, k]
      s = b["image_starts"][r, k]
      for i in range(hh):
        for j in range(ww):
          want[r, s + i * ww + j] = img[r, k, gc * i + j]
  np.testing.assert_array_equal(got, want)
  # every placeholder token got an image embedding, nothing else changed
  changed = (got != h).any(-1)
  np.testing.assert_array_equal(changed, b["image_mask"])


def test_placeholder_mismatch_is_an_error_naming_the_row():
  rng = np.random.default_rng(1)
  b = rows(rng)
  bad = dict(b, image_mask=b["image_mask"].copy())
  bad["image_mask"][1, int(b["image_starts"][1, 0]) + 3] = False
  with pytest.raises(ValueError, match=r"row 1: 15 placeholder tokens do not match its 1 images"):
    check_image_batch(bad, cell_px=42, max_image_size=CANVAS)
  bad = dict(b, image_cells=b["image_cells"].copy())
  bad["image_cells"][0, 2] = (1, 2)
  with pytest.raises(ValueError, match=r"row 0: .* do not match its 3 images"):
    check_image_batch(bad, cell_px=42, max_image_size=CANVAS)
  bad = dict(b, image_count=np.asarray([3, 1, 1], np.int32))
  with pytest.raises(ValueError, match=r"row 2: image 0 has 0×0 cells"):
    check_image_batch(bad, cell_px=42, max_image_size=CANVAS)
  bad = dict(b, image_count=np.asarray([2, 1, 0], np.int32))
  with pytest.raises(ValueError, match=r"row 0: image slots beyond image_count 2"):
    check_image_batch(bad, cell_px=42, max_image_size=CANVAS)


def test_canvas_and_channel_rules():
  rng = np.random.default_rng(2)
  b = rows(rng)
  with pytest.raises(ValueError, match=r"4 channels; the model takes RGB"):
    check_image_batch(dict(b, images=np.zeros((3, M, CANVAS, CANVAS, 4), np.uint8)),
                      cell_px=42, max_image_size=CANVAS)
  with pytest.raises(ValueError, match=r"at most vision.max_image_size=126"):
    check_image_batch(b, cell_px=42, max_image_size=126)
  with pytest.raises(ValueError, match=r"multiple of 42 px"):
    check_image_batch(dict(b, images=np.zeros((3, M, 170, 170, 3), np.uint8)),
                      cell_px=42, max_image_size=CANVAS)


def _png(arr, mode):
  buf = io.BytesIO()
  Image.fromarray(arr, mode=mode).save(buf, format="PNG")
  return buf.getvalue()


def test_data_image_rule_resizes_converts_or_rejects():
  """The rule the vision pathway relies on (data/images.py): every image reaches the model as RGB
  on whole 42-px cells within the maximum, or is rejected by name."""
  rng = np.random.default_rng(3)
  tiny = data_images.load_image(_png(rng.integers(0, 256, (20, 30), dtype=np.uint8), "L"), None, 168)
  assert tiny.shape == (42, 42, 3)                            # below one cell: upscaled, L -> RGB
  huge = data_images.load_image(_png(rng.integers(0, 256, (900, 300, 4), dtype=np.uint8), "RGBA"),
                                None, 168)
  assert huge.shape == (168, 42, 3)     # 900 × 300 fitted into 168 px (168 × 56), then 4 × 1 cells
  with pytest.raises(data_images.ImageRejected, match="image_channels"):
    data_images.load_image(_png(rng.integers(0, 256, (50, 50, 2), dtype=np.uint8), "LA"), None, 168)
