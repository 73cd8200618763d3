"""The project's best-fit packer and packed-row layout (docs/design.md §T3).

`BestFitPacker` keeps a persistent pool of up to `max_bins` open bins (rows being filled). Items
are references `[..., start, stop]` to token ranges of document pieces (the pipeline uses
`[stream, index, piece, start, stop]`), which keeps the packer's state small and JSON-able.

Placement of an item of `n = stop - start` tokens (*cuttable* = a text piece, no image inside):

1. Items are waiting (step 5) and this one is cuttable: it fills the fullest open bin -- its
   first `r` tokens, `r` = that bin's room, when it is longer (a *cut*) -- and the rest is placed
   anew. The filled bin is emitted and its slot goes to the waiting items.
2. `n == seq_len`: a full row by itself.
3. Best fit: the open bin with the least room that still fits it (tokens and image slots; ties
   to the lowest slot); else a free slot opens a new bin. A bin left with no room is emitted.
4. No bin fits, no free slot, cuttable: it fills the fullest bin as in step 1.
5. No bin fits, no free slot, not cuttable: it waits. Whenever a bin is emitted, waiting items
   are offered the room, oldest first. Only if the waiting items hold more tokens than the pool
   (`max_bins * seq_len`) is the fullest bin closed early -- the one case where padding arises
   while data keeps coming.

A cut costs one target (the fragment's last token) and never falls inside an image span; it is
how rows are filled exactly when the documents' lengths do not add up. Cutting is a switch
(`cut=True`, `data.packer_cuts`): the default, because it keeps rows full, at the price of
splitting pieces across rows; the pipeline logs its rate (`packer/cut_rate`, cuts per piece). With
`cut=False` every piece is treated as not cuttable: no piece is ever split, and the rows that
step 5 closes early carry the padding instead.

`flush()` (end of a finite stream) places the waiting items and emits every open bin. Unlike
grain's `BestFitPackIterDataset`, nothing is flushed wholesale during training, so rows are full.

`assemble_row` lays the pieces of one bin out as a row: `tokens`, `targets` (the next token in
the same piece), `loss_mask` (false on padding, on each piece's last token, and where the token
or its target is an image placeholder), `segment_ids` (0 = padding, pieces numbered from 1),
`positions` (restarting at 0 in each piece), `image_mask` (placeholder tokens) and the row's
images: `images` uint8 [M, P, P, 3] (top-left aligned, zero elsewhere), `image_count`,
`image_cells` [M, 2] = (h_cells, w_cells) and `image_starts` [M] (row index of the first
placeholder token; -1 for an empty slot).
"""

from __future__ import annotations

import collections

import numpy as np


def ref_len(ref) -> int:
  return ref[-1] - ref[-2]


class BestFitPacker:
  """Pool of open bins; see the module docstring."""

  def __init__(self, seq_len: int, max_images: int, max_bins: int, cut: bool = True):
    if max_bins < 1:
      raise ValueError(f"pool_bins={max_bins} must be >= 1")
    self.seq_len, self.max_images, self.max_bins = seq_len, max_images, max_bins
    self.cut = bool(cut)  # False: no piece is ever cut (all are placed as not cuttable)
    self.room = np.full(max_bins, -1, np.int64)  # free tokens per slot; -1 = slot unused
    self.image_room = np.zeros(max_bins, np.int64)
    self.items: list[list | None] = [None] * max_bins
    self.ready: collections.deque = collections.deque()  # emitted bins (lists of refs), FIFO
    self.waiting: list = []  # [ref, n_images] of items that found no place, oldest first
    self.cuts = 0  # pieces cut to fill a bin
    self.early_closes = 0  # bins closed with room left while data kept coming
    self._draining = False

  def add(self, ref: list, n_images: int, cuttable: bool) -> None:
    n = ref_len(ref)
    if not 0 < n <= self.seq_len or n_images > self.max_images:
      raise ValueError(f"piece of {n} tokens / {n_images} images does not fit a row")
    cuttable = cuttable and self.cut
    any_open = bool((self.room >= 0).any())
    if cuttable and self.waiting and any_open:  # step 4': text makes room for waiting items
      self._fill_fullest(ref)
      return
    if n == self.seq_len:
      self.ready.append([ref])
      return
    slot = self._slot_for(n, n_images)
    if slot is not None:
      self._put(slot, ref, n_images)
      return
    if cuttable:
      self._fill_fullest(ref)
      return
    self.waiting.append([ref, n_images])
    if sum(ref_len(r) for r, _ in self.waiting) > self.max_bins * self.seq_len:
      self.early_closes += 1
      self._close(int(np.argmin(np.where(self.room >= 0, self.room, self.seq_len + 1))))

  def _fill_fullest(self, ref) -> None:
    """Put the head of `ref` into the fullest open bin, filling it; place the rest anew."""
    slot = int(np.argmin(np.where(self.room >= 0, self.room, self.seq_len + 1)))
    r = int(self.room[slot])
    if r >= ref_len(ref):
      self._put(slot, ref, 0)
      return
    self.cuts += 1
    self._put(slot, ref[:-1] + [ref[-2] + r], 0)
    self.add(ref[:-2] + [ref[-2] + r, ref[-1]], 0, True)

  def _slot_for(self, n: int, n_images: int) -> int | None:
    """Best fit among open bins, else a free slot (opened), else None."""
    fits = (self.room >= n) & (self.image_room >= n_images)
    if fits.any():
      return int(np.argmin(np.where(fits, self.room, self.seq_len + 1)))
    free = np.flatnonzero(self.room < 0)
    if not len(free):
      return None
    slot = int(free[0])
    self.room[slot], self.image_room[slot], self.items[slot] = self.seq_len, self.max_images, []
    return slot

  def _put(self, slot: int, ref, n_images) -> None:
    self.items[slot].append(ref)
    self.room[slot] -= ref_len(ref)
    self.image_room[slot] -= n_images
    if self.room[slot] == 0:
      self._close(slot)

  def _close(self, slot: int) -> None:
    self.ready.append(self.items[slot])
    self.items[slot] = None
    self.room[slot] = -1
    self.image_room[slot] = 0
    self._drain()

  def _drain(self) -> None:
    """Offer the waiting items (oldest first) the pool's room, until none can move."""
    if self._draining:
      return
    self._draining = True
    try:
      while self.waiting and self._place_waiting():
        pass
    finally:
      self._draining = False

  def _place_waiting(self) -> bool:
    """Put every waiting item that fits an open bin; True if any moved."""
    moved, rest = False, []
    for ref, n_images in self.waiting:
      slot = self._slot_for(ref_len(ref), n_images)
      if slot is None:
        rest.append([ref, n_images])
      else:
        self._put(slot, ref, n_images)
        moved = True
    self.waiting = rest
    return moved

  def flush(self) -> None:
    """Place the waiting items and emit every open bin (end of a finite stream)."""
    self._draining = True
    try:
      while True:
        for slot in range(self.max_bins):
          if self.room[slot] >= 0:
            self._close(slot)
        if not self.waiting:
          return
        self._place_waiting()
    finally:
      self._draining = False

  def get_state(self) -> dict:
    return {"room": self.room.tolist(), "image_room": self.image_room.tolist(),
            "items": self.items, "ready": list(self.ready), "waiting": self.waiting,
            "cuts": self.cuts, "early_closes": self.early_closes}

  def set_state(self, state: dict) -> None:
    if len(state["room"]) != self.max_bins:
      raise ValueError(f"packer state has {len(state['room'])} bins, config says {self.max_bins}")
    self.room = np.asarray(state["room"], np.int64)
    self.image_room = np.asarray(state["image_room"], np.int64)
    self.items = [None if b is None else [list(r) for r in b] for b in state["items"]]
    self.ready = collections.deque([list(r) for r in b] for b in state["ready"])
    self.waiting = [[list(r), int(n)] for r, n in state["waiting"]]
    self.cuts, self.early_closes = int(state["cuts"]), int(state["early_closes"])

  def refs(self):
    """Every reference the packer holds (open bins, emitted-not-taken rows, waiting)."""
    for b in self.items:
      yield from b or ()
    for b in self.ready:
      yield from b
    for ref, _ in self.waiting:
      yield ref


def empty_row(seq_len: int, max_images: int, max_px: int) -> dict:
  return {
      "tokens": np.zeros(seq_len, np.int32),
      "targets": np.zeros(seq_len, np.int32),
      "loss_mask": np.zeros(seq_len, bool),
      "segment_ids": np.zeros(seq_len, np.int32),
      "positions": np.zeros(seq_len, np.int32),
      "image_mask": np.zeros(seq_len, bool),
      "images": np.zeros((max_images, max_px, max_px, 3), np.uint8),
      "image_count": np.zeros((), np.int32),
      "image_cells": np.zeros((max_images, 2), np.int32),
      "image_starts": np.full(max_images, -1, np.int32),
  }


def assemble_row(pieces, seq_len: int, max_images: int, max_px: int, pad_id: int,
                 image_pad_id: int, features=None, pad_features: dict | None = None) -> dict:
  """One packed row from `documents.Piece`s (see the module docstring).

  With token `features` (`pipeline.py`), `row[features.name]` holds each piece's precomputed
  features, the first `features.lookback` positions of a continued slice recomputed (its context
  was cut away), and the padding's from `pad_features` (features of a run of seq_len pad tokens
  in segment 0: a shorter run's are its prefix)."""
  row = empty_row(seq_len, max_images, max_px)
  row["tokens"][:] = pad_id
  row["targets"][:] = pad_id
  at, k = 0, 0
  for seg, p in enumerate(pieces, start=1):
    n = len(p)
    row["tokens"][at:at + n] = p.tokens
    row["targets"][at:at + n - 1] = p.tokens[1:]
    is_pad = p.tokens == image_pad_id
    row["loss_mask"][at:at + n - 1] = ~(is_pad[:-1] | is_pad[1:])
    row["segment_ids"][at:at + n] = seg
    row["positions"][at:at + n] = np.arange(n, dtype=np.int32)
    row["image_mask"][at:at + n] = is_pad
    for start, (h, w), pix in zip(p.image_starts, p.image_cells, p.images):
      row["images"][k, :pix.shape[0], :pix.shape[1]] = pix
      row["image_cells"][k] = (h, w)
      row["image_starts"][k] = at + start
      k += 1
    at += n
  row["image_count"][...] = k
  if features is not None:
    row[features.name] = _row_features(pieces, seq_len, image_pad_id, features, pad_features)
  return row


def _row_features(pieces, seq_len: int, image_pad_id: int, features, pad_features) -> dict:
  out = {key: np.empty_like(v) for key, v in pad_features.items()}  # [seq_len, C] each
  at = 0
  for p in pieces:
    n = len(p)
    for key, v in p.features.items():
      out[key][at:at + n] = v
    if p.continued:  # recompute the positions whose look-back crossed the cut
      m = min(features.lookback, n)
      head = p.tokens[None, :m]
      fixed = features(head, np.ones_like(head), head == image_pad_id)
      for key, v in fixed.items():
        out[key][at:at + m] = v[0]
    at += n
  for key, v in pad_features.items():  # the padding run starts at `at`: the run's prefix
    out[key][at:] = v[:seq_len - at]
  return out


def stack_rows(rows: list[dict]) -> dict:
  """Rows stacked along a new leading axis; dict values (token features) key by key."""
  def stack(values):
    if isinstance(values[0], dict):
      return {k: np.stack([v[k] for v in values]) for k in values[0]}
    return np.stack(values)
  return {k: stack([r[k] for r in rows]) for k in rows[0]}
