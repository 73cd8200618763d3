"""Tests of data/documents.py: document layout and the deterministic split."""

import numpy as np
import pytest

from data import documents


def doc_with_images(rng, n_text_runs, pad=5, begin=3, end=4):
  toks, starts, cells = [1], [], []
  for _ in range(n_text_runs):
    toks += list(rng.integers(10, 300, size=int(rng.integers(0, 40))))
    if rng.random() < 0.6:
      h, w = (int(v) for v in rng.integers(1, 4, size=2))
      toks.append(begin)
      starts.append(len(toks))
      toks += [pad] * (h * w)
      toks.append(end)
      cells.append((h, w))
  toks.append(2)
  return documents.Document(np.asarray(toks, np.int32), np.asarray(starts, np.int32),
                            np.asarray(cells, np.int32).reshape(-1, 2),
                            [np.zeros((h * 42, w * 42, 3), np.uint8) for h, w in cells])


@pytest.mark.parametrize("seed", range(4))
def test_split_never_cuts_an_image_and_tiles_the_document(seed):
  rng = np.random.default_rng(seed)
  for _ in range(50):
    doc = doc_with_images(rng, int(rng.integers(1, 30)))
    seq_len, max_images = int(rng.integers(12, 80)), int(rng.integers(1, 4))
    ps = documents.pieces(doc, seq_len, max_images)
    np.testing.assert_array_equal(np.concatenate([p.tokens for p in ps]), doc.tokens)
    assert sum(len(p.images) for p in ps) == len(doc.images)
    for p in ps:
      assert 0 < len(p) <= seq_len and len(p.images) <= max_images
      for s, (h, w) in zip(p.image_starts, p.image_cells):
        assert p.tokens[s - 1] == 3 and (p.tokens[s:s + h * w] == 5).all()
        assert p.tokens[s + h * w] == 4
      assert (p.tokens == 5).sum() == sum(h * w for h, w in p.image_cells)
    cuts = documents.split_points(doc, seq_len, max_images)
    assert cuts == documents.split_points(doc, seq_len, max_images)
    full = [b - a == seq_len for a, b in zip(cuts[:-1], cuts[1:])]
    if not len(doc.images):  # plain text: every piece but the last is exactly seq_len
      assert all(full[:-1])


def test_build_document_layout(small_tok, tmp_path):
  from PIL import Image
  Image.new("RGB", (90, 50), (200, 10, 10)).save(tmp_path / "red.png")
  segs = [("text", "look at this"), ("image", None, str(tmp_path / "red.png")),
          ("text", "a red box")]
  doc = documents.build_document(segs, small_tok, 168)
  t = small_tok
  a, b = t.encode("look at this"), t.encode("a red box")
  expect = ([t.bos_id] + a.tolist() + [t.image_begin_id] + [t.image_pad_id] * 2 +
            [t.image_end_id] + b.tolist() + [t.eos_id])
  assert doc.tokens.tolist() == expect
  assert doc.image_starts.tolist() == [2 + len(a)]
  assert doc.image_cells.tolist() == [[1, 2]]
  assert doc.images[0].shape == (42, 84, 3)
