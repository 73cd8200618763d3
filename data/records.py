"""Record schema: what a source element means, and how a bad one is named (docs/design.md §T3).

A source yields payloads `(kind, value, base_dir)`, optionally followed by `where` (the record's
`file:line`, for the skip report):

- `("json", bytes, dir)`: one JSONL line or one ArrayRecord record, a UTF-8 JSON object;
- `("row", dict, dir)`: one Parquet row;
- `("text", bytes, None)`: a whole UTF-8 text file (the default corpus);
- `("segments", list, None)`: an already-built multimodal record (the generated image docs);
- `("too_large", n_bytes, None)`: a record the shard reader did not read, being larger than
  `data.max_record_bytes`.

The object is either a text record `{"text": str}` or a multimodal record
`{"segments": [seg, ...]}` whose ordered segments are `{"text": str}`, `{"image": path}`
(relative to the shard's directory), `{"image_bytes": bytes}` (Parquet) or
`{"image_base64": str}` (JSON). `parse_record` turns a payload into a list of segments
`("text", str)` / `("image", bytes | None, path | None)`, or raises `RecordSkipped` whose
`reason` is the counter the pipeline increments: `invalid_utf8`, `malformed_json`,
`malformed_record`, `empty_text`, `record_too_large` (more than `max_record_bytes` encoded bytes:
checked before any JSON parsing or tokenizing).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from data import images


class RecordSkipped(ValueError):
  """A record the pipeline skips; `reason` names its counter."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = reason


def _text(value: Any) -> str:
  if isinstance(value, bytes):
    try:
      value = value.decode("utf-8")
    except UnicodeDecodeError as e:
      raise RecordSkipped("invalid_utf8", str(e)) from None
  if not isinstance(value, str):
    raise RecordSkipped("malformed_record", f"text is {type(value).__name__}")
  return value


def _segment(seg: Any, base_dir: str | None):
  if not isinstance(seg, dict):
    raise RecordSkipped("malformed_record", f"segment is {type(seg).__name__}")
  keys = [k for k in ("text", "image", "image_bytes", "image_base64") if seg.get(k) is not None]
  if len(keys) != 1:
    raise RecordSkipped("malformed_record", f"segment keys {sorted(seg)}")
  key = keys[0]
  value = seg[key]
  if key == "text":
    return ("text", _text(value))
  if key == "image":
    if not isinstance(value, str):
      raise RecordSkipped("malformed_record", "image path is not a string")
    return ("image", None, images.resolve(value, base_dir))
  if key == "image_bytes":
    if not isinstance(value, (bytes, bytearray)):
      raise RecordSkipped("malformed_record", "image_bytes is not bytes")
    return ("image", bytes(value), None)
  try:
    return ("image", base64.b64decode(value, validate=True), None)
  except (binascii.Error, TypeError, ValueError) as e:
    raise RecordSkipped("malformed_record", f"image_base64: {e}") from None


def from_object(obj: Any, base_dir: str | None) -> list[tuple]:
  """Segments of a decoded record object (see the module docstring)."""
  if not isinstance(obj, dict):
    raise RecordSkipped("malformed_record", f"record is {type(obj).__name__}")
  if obj.get("segments") is not None:
    segs = obj["segments"]
    if not isinstance(segs, list):
      raise RecordSkipped("malformed_record", "segments is not a list")
    out = [_segment(s, base_dir) for s in segs]
  elif "text" in obj:
    out = [("text", _text(obj["text"]))]
  else:
    raise RecordSkipped("malformed_record", f"no 'text' or 'segments' among {sorted(obj)}")
  out = [s for s in out if s[0] != "text" or s[1]]
  if not any(s[0] == "image" or s[1].strip() for s in out):
    raise RecordSkipped("empty_text")
  return out


MAX_RECORD_BYTES = 64 * 2**20  # the default of data.max_record_bytes (data/config.py)


def _size(value: Any) -> int:
  """Encoded bytes of a decoded row: its strings and byte strings, summed (Parquet)."""
  if isinstance(value, (bytes, bytearray, str)):
    return len(value)
  if isinstance(value, dict):
    return sum(_size(v) for v in value.values())
  if isinstance(value, (list, tuple)):
    return sum(_size(v) for v in value)
  return 8


def parse_record(payload: tuple, max_record_bytes: int = MAX_RECORD_BYTES) -> list[tuple]:
  """Segments of one source payload, or RecordSkipped."""
  kind, value, base_dir = payload[:3]
  if kind == "too_large" or (kind in ("json", "text") and len(value) > max_record_bytes) or (
      kind == "row" and _size(value) > max_record_bytes):
    size = value if kind == "too_large" else (len(value) if kind != "row" else _size(value))
    raise RecordSkipped("record_too_large",
                        f"{size} bytes, more than data.max_record_bytes={max_record_bytes}")
  if kind == "json":
    text = _text(value)
    if not text.strip():
      raise RecordSkipped("empty_text", "blank line")
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise RecordSkipped("malformed_json", str(e)) from None
    return from_object(obj, base_dir)
  if kind == "row":
    return from_object(value, base_dir)
  if kind == "text":
    return from_object({"text": value}, None)
  if kind == "segments":
    return from_object({"segments": value}, None)
  raise ValueError(f"unknown payload kind {kind!r}")
