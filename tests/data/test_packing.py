"""Tests of data/packing.py: the best-fit pool and the packed-row layout."""

import collections

import numpy as np
import pytest

from data import documents, packing


def run_packer(rng, seq_len, max_images, bins, n_docs, full_fraction=0.2):
  """Feed random pieces; returns (rows of refs, {doc: length}, {doc: n_images}, packer)."""
  p = packing.BestFitPacker(seq_len, max_images, bins)
  lengths, n_img = {}, {}
  for d in range(n_docs):
    if rng.random() < 0.3:  # an image document: not cuttable
      n, k = int(rng.integers(4, seq_len // 2)), int(rng.integers(1, max_images + 1))
    elif rng.random() < full_fraction:
      n, k = seq_len, 0
    else:
      n, k = int(rng.integers(1, seq_len)), 0
    lengths[d], n_img[d] = n, k
    p.add([d, 0, n], k, cuttable=k == 0)
  p.flush()
  return list(p.ready), lengths, n_img, p


@pytest.mark.parametrize("seed,bins", [(0, 1), (1, 4), (2, 16)])
def test_every_token_exactly_once_and_in_order(seed, bins):
  rng = np.random.default_rng(seed)
  seq_len, max_images = 64, 3
  rows, lengths, n_img, p = run_packer(rng, seq_len, max_images, bins, 600)
  frags = collections.defaultdict(list)
  for r, row in enumerate(rows):
    assert sum(b - a for _, a, b in row) <= seq_len
    assert sum(n_img[d] for d, a, b in row if a == 0) <= max_images
    for d, a, b in row:
      assert 0 <= a < b <= lengths[d]
      frags[d].append((r, a, b))
  assert set(frags) == set(lengths)
  for d, fs in frags.items():
    by_offset = sorted(fs, key=lambda f: f[1])
    assert by_offset[0][1] == 0 and by_offset[-1][2] == lengths[d]
    assert all(x[2] == y[1] for x, y in zip(by_offset, by_offset[1:]))  # tiles, no overlap
    assert [f[0] for f in by_offset] == sorted(f[0] for f in by_offset)  # emitted in order
    if n_img[d]:
      assert len(fs) == 1  # pieces holding images are never cut
  assert p.cuts == sum(len(fs) - 1 for fs in frags.values())


def test_rows_are_full_unless_closed_early():
  rng = np.random.default_rng(3)
  seq_len = 64
  p = packing.BestFitPacker(seq_len, 4, 8)
  tokens = 0
  for d in range(3000):
    n = int(rng.integers(1, seq_len + 1))
    k = int(rng.random() < 0.2)
    tokens += n
    p.add([d, 0, n], k, cuttable=k == 0)
  rows = list(p.ready)
  short = sum(sum(b - a for _, a, b in row) < seq_len for row in rows)
  assert short == p.early_closes  # the only source of padding while data keeps coming
  assert short <= 0.01 * len(rows)
  assert len(rows) >= 0.95 * tokens / seq_len


def test_best_fit_choice_against_naive_scan():
  rng = np.random.default_rng(4)
  p = packing.BestFitPacker(200, 100, 6)
  checked = 0
  for d in range(400):
    n = int(rng.integers(1, 40))
    rooms = p.room.tolist()
    fits = [s for s in range(6) if rooms[s] >= n]
    free = [s for s in range(6) if rooms[s] < 0]
    expect = min(fits, key=lambda s: (rooms[s], s)) if fits else (free[0] if free else None)
    ready_before, waited = len(p.ready), bool(p.waiting)
    p.add([d, 0, n], 1, cuttable=False)
    if waited:  # emitting a bin may move waiting items anywhere; the naive model stops here
      continue
    checked += 1
    if expect is None:
      assert p.waiting[-1] == [[d, 0, n], 1]
    elif rooms[expect] == n:  # it filled the bin exactly: emitted
      assert p.ready[ready_before][-1] == [d, 0, n]
    else:
      assert p.items[expect][-1] == [d, 0, n]
      assert p.room[expect] == (200 if rooms[expect] < 0 else rooms[expect]) - n
  assert checked > 100


def test_state_round_trip_continues_identically():
  rng = np.random.default_rng(5)
  items = [(int(rng.integers(1, 50)), int(rng.random() < 0.3)) for _ in range(500)]
  a = packing.BestFitPacker(50, 2, 5)
  for d, (n, k) in enumerate(items[:250]):
    a.add([d, 0, n], k, cuttable=k == 0)
  b = packing.BestFitPacker(50, 2, 5)
  import json
  b.set_state(json.loads(json.dumps(a.get_state())))
  for d, (n, k) in enumerate(items[250:], start=250):
    a.add([d, 0, n], k, cuttable=k == 0)
    b.add([d, 0, n], k, cuttable=k == 0)
  assert a.get_state() == b.get_state()


def naive_row(pieces, seq_len, pad_id, image_pad_id):
  toks, tgts, mask, seg, pos, img = [], [], [], [], [], []
  for s, p in enumerate(pieces, start=1):
    t = [int(x) for x in p.tokens]
    for i, x in enumerate(t):
      toks.append(x)
      nxt = t[i + 1] if i + 1 < len(t) else None
      tgts.append(pad_id if nxt is None else nxt)
      mask.append(nxt is not None and x != image_pad_id and nxt != image_pad_id)
      seg.append(s)
      pos.append(i)
      img.append(x == image_pad_id)
  fill = seq_len - len(toks)
  return (toks + [pad_id] * fill, tgts + [pad_id] * fill, mask + [False] * fill,
          seg + [0] * fill, pos + [0] * fill, img + [False] * fill)


def random_piece(rng, n_images, pad=5, begin=3, end=4):
  toks, starts, cells, pix = [1], [], [], []
  for _ in range(n_images):
    toks += list(rng.integers(10, 300, size=int(rng.integers(0, 6))))
    h, w = (int(v) for v in rng.integers(1, 4, size=2))
    toks.append(begin)
    starts.append(len(toks))
    toks += [pad] * (h * w)
    toks.append(end)
    cells.append((h, w))
    pix.append(rng.integers(0, 256, size=(h * 42, w * 42, 3), dtype=np.uint8))
  toks += list(rng.integers(10, 300, size=int(rng.integers(0, 8)))) + [2]
  return documents.Piece(np.asarray(toks, np.int32), np.asarray(starts, np.int32),
                         np.asarray(cells, np.int32).reshape(-1, 2), pix)


def test_assemble_row_matches_naive_layout():
  rng = np.random.default_rng(6)
  seq_len, max_images, max_px = 160, 4, 126
  for _ in range(20):
    pieces, total, n_img = [], 0, 0
    while True:
      p = random_piece(rng, int(rng.integers(0, 2)))
      if total + len(p) > seq_len or n_img + len(p.images) > max_images:
        break
      pieces.append(p)
      total += len(p)
      n_img += len(p.images)
    row = packing.assemble_row(pieces, seq_len, max_images, max_px, pad_id=0, image_pad_id=5)
    ref = naive_row(pieces, seq_len, 0, 5)
    for key, r in zip(("tokens", "targets", "loss_mask", "segment_ids", "positions",
                       "image_mask"), ref):
      np.testing.assert_array_equal(row[key], np.asarray(r), err_msg=key)
    assert int(row["image_count"]) == n_img
    k, at = 0, 0
    for p in pieces:
      for s, (h, w), pix in zip(p.image_starts, p.image_cells, p.images):
        start = int(row["image_starts"][k])
        assert start == at + s
        span = row["tokens"][start - 1:start + h * w + 1]
        assert span[0] == 3 and span[-1] == 4 and (span[1:-1] == 5).all()
        np.testing.assert_array_equal(row["images"][k, :h * 42, :w * 42], pix)
        assert not row["images"][k, h * 42:].any() and not row["images"][k, :, w * 42:].any()
        np.testing.assert_array_equal(row["image_cells"][k], (h, w))
        k += 1
      at += len(p)
    assert (row["image_starts"][k:] == -1).all()


def test_piece_slice_keeps_images_inside():
  rng = np.random.default_rng(7)
  p = random_piece(rng, 3)
  s0 = int(p.image_starts[1]) - 1  # just before the second image's begin marker
  a, b = p.slice(0, s0), p.slice(s0, len(p))
  assert len(a.images) == 1 and len(b.images) == 2
  np.testing.assert_array_equal(np.concatenate([a.tokens, b.tokens]), p.tokens)
  np.testing.assert_array_equal(b.image_starts, p.image_starts[1:] - s0)


def test_cuts_off_never_splits_a_piece_and_pads_only_early_closes():
  """`cut=False`: every piece lands whole in one row; all tokens once; padding only in the rows
  closed early while data kept coming (and the final flush)."""
  rng = np.random.default_rng(7)
  seq_len = 64
  p = packing.BestFitPacker(seq_len, 3, 8, cut=False)
  lengths = {}
  for d in range(2000):
    n, k = int(rng.integers(1, seq_len + 1)), int(rng.random() < 0.2)
    lengths[d] = n
    p.add([d, 0, n], k, cuttable=k == 0)
  before_flush = len(p.ready)
  short = sum(sum(b - a for _, a, b in row) < seq_len for row in list(p.ready))
  p.flush()
  placed = [ref for row in p.ready for ref in row]
  assert sorted((d, a, b) for d, a, b in placed) == [(d, 0, n) for d, n in sorted(lengths.items())]
  assert p.cuts == 0 and short == p.early_closes > 0
  assert before_flush > 0.9 * sum(lengths.values()) / seq_len


def test_cut_rate_counter_is_cuts_per_piece(corpus_dir, small_tok):
  """`packer/cut_rate` restated from the fragments the packer made: every reference in the rows
  taken so far or still held, (fragments − pieces) / pieces; zero with `packer_cuts` off."""
  from data import pipeline
  from tests.data.conftest import make_data

  class Tap(collections.deque):   # records the rows the iterator takes from the packer
    def popleft(self):
      taken.append(super().popleft())
      return taken[-1]

  for cuts in (True, False):
    it = pipeline.make_train_iterator(make_data(corpus_dir, packer_cuts=cuts), tokenizer=small_tok)
    taken = []
    it.packer.ready = Tap(it.packer.ready)
    for _ in range(6):
      next(it)
    refs = [r for row in taken for r in row] + list(it.packer.refs())
    pieces = {tuple(r[:3]) for r in refs}
    c = it.counters()
    assert c["pieces"] == len(pieces)
    assert c["packer/cut_rate"] == (len(refs) - len(pieces)) / len(pieces)
    assert (c["packer/cut_rate"] > 0) == cuts
