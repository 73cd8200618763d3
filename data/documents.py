"""Documents: a record's segments as one token sequence with image spans, and its deterministic
split into pieces of at most `seq_len` tokens (docs/design.md §T3).

Layout of a document: `<|begin_of_text|>`, then each segment in order -- text as its tokens, an
image as `<|image_begin|>`, `h_cells * w_cells` x `<|image_pad|>`, `<|image_end|>` -- then
`<|end_of_text|>`. An image's *span start* is the index of its first `<|image_pad|>`. A document
holds at most `max_tokens` tokens (`data.max_document_tokens`): the text and images past that are
left out, the end marker kept, and `Document.truncated` says so.

Splitting (`split_points`): greedy cuts every `seq_len` tokens, except that a cut that would fall
inside an image block (begin marker to end marker) moves back to just before the begin marker,
and a piece that would hold more than `max_images_per_row` images is cut before the extra one.
`pipeline.check_config` guarantees an image block fits in a row, so every piece is non-empty and
no image is ever split.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from data import images
from data.records import RecordSkipped
from data.tokenizer import TokenizerHandle


@dataclasses.dataclass
class Document:
  """One tokenized record. `images[k]` is uint8 [h_cells*42, w_cells*42, 3]."""
  tokens: np.ndarray  # int32 [L]
  image_starts: np.ndarray  # int32 [n_images], index of each image's first placeholder token
  image_cells: np.ndarray  # int32 [n_images, 2], (h_cells, w_cells)
  images: list
  truncated: bool = False  # cut at max_tokens: the record's later text and images are left out

  def __len__(self) -> int:
    return len(self.tokens)


def build_document(segments: list[tuple], tok: TokenizerHandle, max_image_size: int,
                   max_image_pixels: int = images.MAX_PIXELS,
                   max_file_bytes: int = images.MAX_FILE_BYTES,
                   max_tokens: int = 2**20) -> Document:
  """Tokenize segments and decode their images, at most `max_tokens` tokens in all (the rest is
  left out, see the module docstring); RecordSkipped for a bad image."""
  parts = [np.asarray([tok.bos_id], np.int32)]
  length = 1
  starts, cells, pixels = [], [], []
  truncated = False
  for seg in segments:
    room = max_tokens - 1 - length  # the end marker's place kept
    if seg[0] == "text":
      ids, complete = tok.encode_prefix(seg[1], room)
      parts.append(ids)
      length += len(ids)
      if not complete:
        truncated = True
        break
      continue
    try:
      pix = images.load_image(seg[1], seg[2], max_image_size, max_image_pixels, max_file_bytes)
    except images.ImageRejected as e:
      raise RecordSkipped(e.reason, str(e)) from None
    h, w = pix.shape[0] // images.CELL_PX, pix.shape[1] // images.CELL_PX
    if h * w + 2 > room:
      truncated = True
      break
    span = np.full(h * w + 2, tok.image_pad_id, np.int32)
    span[0], span[-1] = tok.image_begin_id, tok.image_end_id
    parts.append(span)
    starts.append(length + 1)
    cells.append((h, w))
    pixels.append(pix)
    length += len(span)
  parts.append(np.asarray([tok.eos_id], np.int32))
  return Document(np.concatenate(parts), np.asarray(starts, np.int32).reshape(-1),
                  np.asarray(cells, np.int32).reshape(-1, 2), pixels, truncated)


def split_points(doc: Document, seq_len: int, max_images: int) -> list[int]:
  """Piece boundaries [0, c1, ..., len(doc)]: pieces of <= seq_len tokens holding at most
  `max_images` images, no image split."""
  blocks = [(int(s) - 1, int(s) + int(h * w) + 1) for s, (h, w) in zip(doc.image_starts,
                                                                        doc.image_cells)]
  cuts, start, n = [0], 0, len(doc)
  while True:
    cut = min(n, start + seq_len)
    for b0, b1 in blocks:  # [b0, b1) is one image block
      if b0 < cut < b1:
        cut = b0
        break
    inside = [b0 for b0, _ in blocks if start <= b0 < cut]
    if len(inside) > max_images:
      cut = inside[max_images]
    if cut == n:
      break
    if cut <= start:
      raise ValueError(f"an image block of {blocks} does not fit a row of {seq_len} tokens")
    cuts.append(cut)
    start = cut
  cuts.append(n)
  return cuts


@dataclasses.dataclass
class Piece:
  """Tokens [start, stop) of a document, with the images whose spans lie inside, and optional
  per-token features (`pipeline.py`'s token features: name -> [len, C] arrays)."""
  tokens: np.ndarray
  image_starts: np.ndarray  # relative to the piece
  image_cells: np.ndarray
  images: list
  features: dict = dataclasses.field(default_factory=dict)
  continued: bool = False  # a slice that starts inside the piece (its first tokens lost context)

  def __len__(self) -> int:
    return len(self.tokens)

  def slice(self, a: int, b: int) -> "Piece":
    """Tokens [a, b) of the piece (the packer cuts only between image spans)."""
    if (a, b) == (0, len(self)):
      return self
    inside = [k for k, s in enumerate(self.image_starts) if a <= s < b]
    return Piece(self.tokens[a:b], self.image_starts[inside] - a, self.image_cells[inside],
                 [self.images[k] for k in inside],
                 {k: v[a:b] for k, v in self.features.items()}, self.continued or a > 0)


def pieces(doc: Document, seq_len: int, max_images: int) -> list[Piece]:
  cuts = split_points(doc, seq_len, max_images)
  out = []
  for a, b in zip(cuts[:-1], cuts[1:]):
    inside = [k for k, s in enumerate(doc.image_starts) if a <= s < b]
    out.append(Piece(doc.tokens[a:b], doc.image_starts[inside] - a, doc.image_cells[inside],
                     [doc.images[k] for k in inside]))
  return out
