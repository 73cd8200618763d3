"""Tests of data/images.py: the decode / channel / size rule."""

import io

import numpy as np
import pytest
from PIL import Image

from data import images


def encode(img: Image.Image, fmt="PNG") -> bytes:
  buf = io.BytesIO()
  img.save(buf, format=fmt)
  return buf.getvalue()


def random_rgb(rng, h, w):
  return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("h,w,max_px,expect", [
    (10, 20, 168, (1, 1)),  # below one cell: upscaled to 42 x 42
    (41, 130, 168, (1, 3)),  # 41/42 -> 1, 130/42 = 3.1 -> 3
    (64, 63, 168, (2, 2)),  # 1.52 -> 2, 1.5 -> 2 (round half to even keeps 2)
    (1000, 500, 168, (4, 2)),  # scaled by 0.168 to 168 x 84
    (5000, 40, 336, (8, 1)),  # extreme aspect: long side capped, short side at least 1 cell
])
def test_cells_rule(h, w, max_px, expect):
  assert images.cells_for(h, w, max_px) == expect


def test_cells_rule_matches_reference_on_random_sizes():
  rng = np.random.default_rng(1)
  for _ in range(500):
    h, w = (int(v) for v in rng.integers(1, 2000, size=2))
    max_px = int(rng.integers(42, 700))
    limit = max_px // 42
    s = min(1.0, max_px / max(h, w))
    ref = tuple(min(limit, max(1, round(v * s / 42))) for v in (h, w))
    got = images.cells_for(h, w, max_px)
    assert got == ref
    assert all(1 <= c <= limit for c in got)


def test_load_resizes_to_cell_multiples():
  rng = np.random.default_rng(2)
  for h, w in ((17, 30), (100, 200), (400, 90)):
    pix = images.load_image(encode(random_rgb(rng, h, w)), None, 168)
    hc, wc = images.cells_for(h, w, 168)
    assert pix.shape == (hc * 42, wc * 42, 3) and pix.dtype == np.uint8


def test_exact_size_is_not_resampled():
  rng = np.random.default_rng(3)
  arr = rng.integers(0, 256, size=(84, 126, 3), dtype=np.uint8)
  pix = images.load_image(encode(Image.fromarray(arr)), None, 168)
  np.testing.assert_array_equal(pix, arr)


def test_grayscale_replicated_to_rgb():
  rng = np.random.default_rng(4)
  arr = rng.integers(0, 256, size=(42, 84), dtype=np.uint8)
  pix = images.load_image(encode(Image.fromarray(arr, "L")), None, 168)
  for c in range(3):
    np.testing.assert_array_equal(pix[..., c], arr)


def test_rgba_composited_over_white():
  rng = np.random.default_rng(5)
  rgb = rng.integers(0, 256, size=(42, 42, 3), dtype=np.uint8)
  alpha = rng.integers(0, 256, size=(42, 42), dtype=np.uint8)
  alpha[0, 0], alpha[0, 1] = 0, 255
  img = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
  pix = images.load_image(encode(img), None, 168).astype(np.float64)
  a = alpha[..., None] / 255.0
  ref = rgb * a + 255.0 * (1 - a)
  assert np.abs(pix - ref).max() <= 1.0  # Pillow composites in 8-bit integer arithmetic
  np.testing.assert_array_equal(pix[0, 0], [255, 255, 255])
  np.testing.assert_array_equal(pix[0, 1], rgb[0, 1])


def test_palette_and_cmyk_converted():
  rng = np.random.default_rng(6)
  img = random_rgb(rng, 42, 42)
  pal = img.convert("P")
  np.testing.assert_array_equal(images.load_image(encode(pal), None, 168),
                                np.asarray(pal.convert("RGB")))
  cmyk = img.convert("CMYK")
  np.testing.assert_array_equal(images.load_image(encode(cmyk, "JPEG"), None, 168).shape,
                                (42, 42, 3))


@pytest.mark.parametrize("mode", ["LA", "I", "F"])
def test_other_channel_layouts_rejected(mode):
  img = Image.new(mode, (42, 42))
  with pytest.raises(images.ImageRejected) as e:
    images.load_image(encode(img, "TIFF"), None, 168)
  assert e.value.reason == "image_channels"


def test_bad_bytes_and_paths(tmp_path):
  with pytest.raises(images.ImageRejected) as e:
    images.load_image(b"", None, 168)
  assert e.value.reason == "image_empty"
  png = encode(Image.new("RGB", (50, 50)))
  for bad in (b"not an image at all", png[: len(png) // 2]):
    with pytest.raises(images.ImageRejected) as e:
      images.load_image(bad, None, 168)
    assert e.value.reason == "image_undecodable"
  with pytest.raises(images.ImageRejected) as e:
    images.load_image(None, str(tmp_path / "missing.png"), 168)
  assert e.value.reason == "image_missing"
  (tmp_path / "ok.png").write_bytes(png)
  assert images.load_image(None, str(tmp_path / "ok.png"), 168).shape == (42, 42, 3)


def test_max_image_size_below_a_cell_is_an_error():
  with pytest.raises(ValueError, match="max_image_size"):
    images.max_cells(41)
