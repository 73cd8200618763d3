"""The safetensors file format, read and written with numpy (docs/checkpoints.md §Files).

A file is an 8-byte little-endian header length N, N bytes of JSON (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`, offsets relative to the byte buffer
after the header), then the buffer: each tensor's C-order bytes, little-endian, without gaps. The
format is small enough to implement here instead of adding the `safetensors` package: reading
goes through `np.memmap`, so a tensor is paged in from disk when it is used and a shard is never
read whole, and writing streams one tensor after the other behind a header computed from the
planned shapes (`ShardWriter`).

Every defect a damaged or foreign file can have is a `FormatError` with one line naming the file
(and the tensor): a missing file, a header that is not JSON, an unknown dtype, offsets outside
the file (a truncated download), a shape that does not fill its bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
from typing import Iterable

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit
if sys.byteorder != "little":  # memory maps and tobytes() use the host's byte order
  raise ImportError("launch.safetensors needs a little-endian host")


class FormatError(ValueError):
  """A file that is not a readable safetensors file; the message names it and what is wrong."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lies: its file, dtype name, shape and byte offset from the file start."""

  path: str
  name: str
  dtype: str
  shape: tuple[int, ...]
  offset: int
  nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
  """The tensors of one file, validated against its size (a truncated file fails here)."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise FormatError(f"{path} is truncated: {size} bytes, shorter than the 8-byte header size")
      n = struct.unpack("<Q", head)[0]
      if n > MAX_HEADER or 8 + n > size:
        raise FormatError(f"{path} is truncated or not a safetensors file: header of {n} bytes, "
                          f"file of {size}")
      raw = f.read(n)
  except FileNotFoundError:
    raise FormatError(f"{path} does not exist") from None
  except OSError as e:
    raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, ValueError):
    raise FormatError(f"{path}: the header is not JSON (not a safetensors file)") from None
  if not isinstance(header, dict):
    raise FormatError(f"{path}: the header is not a JSON object")
  start = 8 + n
  out = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise FormatError(f"{path}: tensor {name} has no dtype, shape or data_offsets") from None
    if dtype not in DTYPES:
      raise FormatError(f"{path}: tensor {name} has the unknown dtype {dtype!r} (known: "
                        f"{', '.join(sorted(DTYPES))})")
    if not all(isinstance(d, int) and d >= 0 for d in shape) or not (
        isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
      raise FormatError(f"{path}: tensor {name} has a bad shape {list(shape)} or offsets "
                        f"{[begin, end]}")
    if int(np.prod(shape)) * DTYPES[dtype].itemsize != end - begin:
      raise FormatError(f"{path}: tensor {name} of shape {list(shape)} and dtype {dtype} does not "
                        f"fill its {end - begin} bytes")
    if start + end > size:
      raise FormatError(f"{path} is truncated: tensor {name} ends at byte {start + end}, the file "
                        f"has {size}")
    out[name] = TensorInfo(path, name, dtype, shape, start + begin, end - begin)
  return out


def read_tensor(info: TensorInfo) -> np.ndarray:
  """The tensor as a read-only memory map (paged in when used)."""
  dtype = DTYPES[info.dtype]
  if info.nbytes == 0:
    return np.zeros(info.shape, dtype)
  return np.memmap(info.path, dtype=dtype, mode="r", offset=info.offset, shape=info.shape)


def header_bytes(tensors: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> bytes:
  """The length prefix and JSON header for (name, dtype name, shape) in file order, padded with
  spaces to a multiple of 8 bytes (as the reference writer does)."""
  header: dict = {"__metadata__": dict(metadata)} if metadata else {}
  offset = 0
  for name, dtype, shape in tensors:
    nbytes = int(np.prod(shape)) * DTYPES[dtype].itemsize
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
  """Writes one file whose tensors (names, dtypes, shapes) are known in advance: whole tensors in
  that order (`write`), or a tensor by blocks of rows in any order (`write_rows`); `close` checks
  that every planned byte came."""

  def __init__(self, path: str, plan: list[tuple[str, str, tuple[int, ...]]],
               metadata: dict[str, str] | None = None):
    self.path, self.plan = path, plan
    self.file = open(path, "wb")
    head = header_bytes(plan, metadata)
    self.file.write(head)
    self.offsets, offset = {}, len(head)
    for name, dtype, shape in plan:
      self.offsets[name] = (offset, DTYPES[dtype], tuple(shape))
      offset += int(np.prod(shape)) * DTYPES[dtype].itemsize
    self.written = dict.fromkeys(self.offsets, 0)
    self.left = offset - len(head)   # planned bytes not written yet
    self.next = 0   # the next planned tensor `write` expects

  def complete(self) -> bool:
    return self.left == 0

  def write(self, name: str, array: np.ndarray) -> None:
    want, dtype, shape = self.plan[self.next]
    if (name, NAMES.get(array.dtype), tuple(array.shape)) != (want, dtype, tuple(shape)):
      raise ValueError(f"{self.path}: tensor {self.next} is planned as {want} {dtype} "
                       f"{list(shape)}, got {name} {NAMES.get(array.dtype)} {list(array.shape)}")
    self.write_rows(name, 0, array)

  def write_rows(self, name: str, start: int, array: np.ndarray) -> None:
    """Rows start:start + len(array) of a planned tensor."""
    offset, dtype, shape = self.offsets[name]
    if array.dtype != dtype or tuple(array.shape[1:]) != shape[1:] or start + len(array) > shape[0]:
      raise ValueError(f"{self.path}: rows {start}:{start + len(array)} {array.dtype} "
                       f"{list(array.shape)} do not fit {name} {dtype} {list(shape)}")
    row = int(np.prod(shape[1:])) * dtype.itemsize
    self.file.seek(offset + start * row)
    self.file.write(np.ascontiguousarray(array).tobytes())  # little-endian host (checked above)
    self.written[name] += array.nbytes
    self.left -= array.nbytes
    if start + len(array) == shape[0] and self.next < len(self.plan) and (
        self.plan[self.next][0] == name):
      self.next += 1

  def close(self) -> None:
    self.file.close()
    missing = [n for n, (_, d, s) in self.offsets.items()
               if self.written[n] != int(np.prod(s)) * d.itemsize]
    if missing:
      raise ValueError(f"{self.path}: {len(missing)} planned tensors were not written completely "
                       f"(first: {missing[0]})")


def write_file(path: str, tensors: dict[str, np.ndarray],
               metadata: dict[str, str] | None = None) -> None:
  """One file holding `tensors` in their insertion order."""
  writer = ShardWriter(path, [(k, NAMES[v.dtype], v.shape) for k, v in tensors.items()], metadata)
  for k, v in tensors.items():
    writer.write(k, v)
  writer.close()
