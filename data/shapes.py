"""Generated image-caption documents for the multimodal stream of the default corpus
(docs/design.md §T3).

Document `i` of a split is a pure function of `(seed, split, i)`: a canvas of random size
(36-200 px a side, so some images are below one 42-px cell and get upscaled) with 1-3 coloured
shapes in cells of a 3 x 3 grid, and a caption that names the count, colour, kind and position
of every shape. None of that is guessable from the text alone, so a model can only lower its
caption loss by reading the image.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 70, 220),
           "yellow": (235, 200, 20), "black": (15, 15, 15), "purple": (140, 40, 170)}
KINDS = ("circle", "square", "triangle")
ROWS = ("top", "middle", "bottom")
COLS = ("left", "center", "right")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_SPLIT_CODE = {"train": 0, "eval": 1}


@dataclasses.dataclass(frozen=True)
class Scene:
  height: int
  width: int
  shapes: tuple  # ((colour, kind, row, col), ...) in drawing order
  template: int


def position_name(row: int, col: int) -> str:
  if row == 1 and col == 1:
    return "the center"
  if row == 1:
    return f"the {COLS[col]}"
  if col == 1:
    return f"the {ROWS[row]}"
  return f"the {ROWS[row]} {COLS[col]}"


def scene(seed: int, split: str, index: int) -> Scene:
  rng = np.random.default_rng((seed, _SPLIT_CODE[split], index))
  height, width = (int(v) for v in rng.integers(36, 201, size=2))
  n = int(rng.integers(1, 4))
  cells = rng.choice(9, size=n, replace=False)
  colours = list(COLOURS)
  shapes = tuple((colours[int(rng.integers(len(colours)))], KINDS[int(rng.integers(3))],
                  int(c) // 3, int(c) % 3) for c in sorted(cells))
  return Scene(height, width, shapes, int(rng.integers(3)))


def caption(s: Scene) -> str:
  """Counts per (colour, kind), each with its positions, in reading order."""
  groups: dict[tuple, list] = {}
  for colour, kind, row, col in s.shapes:
    groups.setdefault((colour, kind), []).append(position_name(row, col))
  parts = []
  for (colour, kind), where in groups.items():
    noun = kind if len(where) == 1 else kind + "s"
    parts.append(f"{NUMBERS[len(where)]} {colour} {noun} at {' and '.join(where)}")
  total = len(s.shapes)
  head = f"{NUMBERS[total].capitalize()} shape{'s' if total > 1 else ''}: "
  return head + "; ".join(parts) + "."


def render(s: Scene) -> Image.Image:
  img = Image.new("RGB", (s.width, s.height), (250, 250, 245))
  draw = ImageDraw.Draw(img)
  ch, cw = s.height / 3, s.width / 3
  for colour, kind, row, col in s.shapes:
    x0, y0 = col * cw + 0.15 * cw, row * ch + 0.15 * ch
    x1, y1 = (col + 1) * cw - 0.15 * cw, (row + 1) * ch - 0.15 * ch
    fill = COLOURS[colour]
    if kind == "circle":
      draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif kind == "square":
      draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
      draw.polygon(((x0 + x1) / 2, y0, x1, y1, x0, y1), fill=fill)
  return img


def png_bytes(img: Image.Image) -> bytes:
  buf = io.BytesIO()
  img.save(buf, format="PNG", compress_level=1)
  return buf.getvalue()


def template_texts(s: Scene) -> tuple[str, str]:
  """(text before the image, text after it) of a scene's record (one of three templates)."""
  text = caption(s)
  if s.template == 0:
    return "", text
  if s.template == 1:
    return "What is in this picture?\n", "\n" + text
  return "Describe the shapes.\n", "\nAnswer: " + text


def segments_text(s: Scene) -> list[str]:
  """The text segments alone (for tokenizer training, without rendering the image)."""
  return [t for t in template_texts(s) if t]


def segments(s: Scene) -> list[dict]:
  """The multimodal record of a scene: [text], image, text."""
  before, after = template_texts(s)
  image = {"image_bytes": png_bytes(render(s))}
  return ([{"text": before}] if before else []) + [image, {"text": after}]


class ShapesSource:
  """`count` generated documents of one split, as `("segments", [...], None)` payloads."""

  def __init__(self, seed: int, split: str, count: int):
    if count <= 0:
      raise ValueError(f"generated image documents for split {split!r}: count={count} must be > 0")
    self.seed, self.split, self.count = seed, split, count

  def __len__(self):
    return self.count

  def __getitem__(self, i):
    if not 0 <= i < self.count:
      raise IndexError(i)
    return ("segments", segments(scene(self.seed, self.split, i)), None)

  def __repr__(self):
    return f"ShapesSource(seed={self.seed}, split={self.split!r}, count={self.count})"
