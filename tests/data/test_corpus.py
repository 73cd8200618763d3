"""Tests of data/corpus.py (manifest, split) and data/shapes.py (captions follow the image)."""

import io
import os
import platform

import numpy as np
from PIL import Image

from data import corpus, shapes


def fake_stdlib(root):
  files = {"a.py": "import os\n", "pkg/__init__.py": "", "pkg/mod.py": "x = 1\n",
           "test/test_a.py": "assert 1\n", "pkg/tests/t.py": "t = 2\n", "notes.txt": "hi",
           "latin.py": None}
  for rel, text in files.items():
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(b"s = '\xe9'\n" if text is None else text.encode())


def test_manifest_lists_sorted_files_and_exclusions(tmp_path):
  fake_stdlib(tmp_path)
  m = corpus.build_manifest(50, 10, 5, 0, root=str(tmp_path))
  assert [f[0] for f in m["files"]] == ["a.py", "pkg/mod.py"]
  assert m["excluded"] == {"not_utf8": ["latin.py"], "empty": ["pkg/__init__.py"]}
  assert m["python"]["version"] == platform.python_version()
  for rel, size, digest, split in m["files"]:
    assert split == ("eval" if corpus.is_heldout(rel, 50) else "train")
  assert corpus.build_manifest(50, 10, 5, 0, root=str(tmp_path)) == m  # deterministic
  (tmp_path / "a.py").write_text("import sys\n")
  changed = corpus.build_manifest(50, 10, 5, 0, root=str(tmp_path))
  assert changed["hash"] != m["hash"]  # content is part of the identity


def test_heldout_split_fraction_and_stability():
  paths = [f"pkg{i // 10}/mod{i}.py" for i in range(4000)]
  held = [p for p in paths if corpus.is_heldout(p, 3)]
  assert 0.02 < len(held) / len(paths) < 0.04
  assert held == [p for p in paths if corpus.is_heldout(p, 3)]


def test_real_stdlib_manifest_and_sources():
  m = corpus.build_manifest(3, 100, 10, 0)
  assert m["stdlib_dir"] == corpus.stdlib_dir() and len(m["files"]) > 300
  assert not any(part in corpus.EXCLUDED_DIRS for f in m["files"] for part in f[0].split(os.sep))
  text_train, mm_train = corpus.sources(m, "train")
  text_eval, _ = corpus.sources(m, "eval")
  assert not set(text_train.paths) & set(text_eval.paths)
  assert len(text_train) + len(text_eval) == len(m["files"])
  assert len(mm_train) == 100
  kind, data, _ = text_train[0]
  assert kind == "text" and data.decode("utf-8")


def colour_at(img: np.ndarray, row: int, col: int, h: int, w: int) -> str | None:
  y, x = int((row + 0.5) * h / 3), int((col + 0.6) * w / 3)  # inside circle, square, triangle
  pix = img[y, x].astype(int)
  best = min(shapes.COLOURS, key=lambda c: np.abs(np.asarray(shapes.COLOURS[c]) - pix).sum())
  return best if np.abs(np.asarray(shapes.COLOURS[best]) - pix).sum() < 60 else None


def test_caption_is_decidable_from_the_image():
  """Reading the rendered pixels back recovers each shape's colour at each named cell."""
  for i in range(60):
    s = shapes.scene(7, "train", i)
    segs = shapes.segments(s)
    png = next(seg["image_bytes"] for seg in segs if "image_bytes" in seg)
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert img.shape == (s.height, s.width, 3)
    cap = shapes.caption(s)
    for colour, kind, row, col in s.shapes:
      assert colour_at(img, row, col, s.height, s.width) == colour
      assert f"{colour} {kind}" in cap and shapes.position_name(row, col) in cap
    occupied = {(r, c) for _, _, r, c in s.shapes}
    for r in range(3):
      for c in range(3):
        if (r, c) not in occupied:
          assert colour_at(img, r, c, s.height, s.width) is None
    assert cap.startswith(shapes.NUMBERS[len(s.shapes)].capitalize())


def test_scenes_are_deterministic_and_splits_differ():
  a = [shapes.scene(0, "train", i) for i in range(50)]
  assert a == [shapes.scene(0, "train", i) for i in range(50)]
  assert a != [shapes.scene(0, "eval", i) for i in range(50)]
