"""Shard readers: JSONL (plain or gzipped), Parquet and ArrayRecord as grain data sources
(docs/design.md §T3).

`open_source(paths)` expands files, directories (their shards, sorted) and globs into an ordered
list of shards and returns one random-access source over all their records; each element is a
payload `(kind, value, base_dir, where)` for `records.parse_record`, `where` = `file:line` (the
record's 1-based line, row or record number in its shard). A path that does not exist or a shard
of an unknown format raises here, naming it and the config key. Records are read on demand, so a
source is cheap to pickle into grain worker processes (gzipped JSONL is the exception: it is
decompressed into memory once, as gzip has no random access).

Memory stays bounded by `max_record_bytes` per record: JSONL files are indexed in 1-MiB chunks and
a longer line is never read (its payload is `("too_large", n_bytes, ...)`); a gzipped line that
grows past the bound is dropped as it is decompressed.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import os
from typing import Sequence

import numpy as np

SHARD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".array_record")
CHUNK = 1 << 20  # bytes read at a time while indexing lines
MAX_RECORD_BYTES = 64 * 2**20  # the default of data.max_record_bytes (data/config.py)


def shard_format(path: str) -> str:
  for suffix in SHARD_SUFFIXES:
    if path.endswith(suffix):
      return suffix
  raise ValueError(f"data shard {path!r} has an unknown format (expected one of {SHARD_SUFFIXES})")


def expand_paths(paths: Sequence[str], name: str = "data source") -> list[str]:
  """Shard files named by `paths` (files, directories, globs), in a fixed order; errors name the
  config key `name` the paths came from."""
  out = []
  if isinstance(paths, str):
    paths = (paths,)
  for p in paths:
    if any(c in p for c in "*?["):
      matches = sorted(glob.glob(p))
      if not matches:
        raise FileNotFoundError(f"{name}: glob {p!r} matches no file; fix the path in {name}")
    elif os.path.isdir(p):
      matches = sorted(os.path.join(p, f) for f in os.listdir(p)
                       if any(f.endswith(s) for s in SHARD_SUFFIXES))
      if not matches:
        raise FileNotFoundError(f"{name}: directory {p!r} holds no shard {SHARD_SUFFIXES}")
    elif os.path.exists(p):
      matches = [p]
    else:
      raise FileNotFoundError(f"{name}: data source {p!r} does not exist; fix the path in {name}")
    for m in matches:
      try:
        shard_format(m)
      except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    out.extend(matches)
  return out


class JsonlShard:
  """One JSONL file; line offsets are indexed once (in chunks), lines are read on demand."""

  def __init__(self, path: str, max_record_bytes: int = MAX_RECORD_BYTES):
    self.path = path
    self.base_dir = os.path.dirname(os.path.abspath(path))
    self.max_record_bytes = max_record_bytes
    newlines, size = [], 0
    with open(path, "rb") as f:
      while chunk := f.read(CHUNK):
        newlines.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + size)
        size += len(chunk)
        last = chunk[-1:]
    newlines = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    starts = np.concatenate([[0], newlines + 1])
    stops = np.concatenate([newlines, [size]])
    if size and last == b"\n":
      starts, stops = starts[:-1], stops[:-1]
    elif not size:
      starts, stops = starts[:0], stops[:0]
    self.starts = starts.astype(np.int64)
    self.stops = stops.astype(np.int64)

  def __len__(self):
    return len(self.starts)

  def __getitem__(self, i):
    where = f"{self.path}:{i + 1}"
    n = int(self.stops[i] - self.starts[i])
    if n > self.max_record_bytes:
      return ("too_large", n, self.base_dir, where)
    with open(self.path, "rb") as f:
      f.seek(int(self.starts[i]))
      line = f.read(n)
    return ("json", line.rstrip(b"\r"), self.base_dir, where)


class GzipJsonlShard:
  """A gzipped JSONL file, decompressed into memory once, in chunks; a line longer than
  `max_record_bytes` is kept as its length only."""

  def __init__(self, path: str, max_record_bytes: int = MAX_RECORD_BYTES):
    self.path = path
    self.base_dir = os.path.dirname(os.path.abspath(path))
    lines: list[bytes | int] = []
    line, over = bytearray(), 0  # the current line, or its length once past the bound
    try:
      with gzip.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
          start = 0
          while start <= len(chunk):
            nl = chunk.find(b"\n", start)
            piece = chunk[start:nl if nl >= 0 else len(chunk)]
            if over or len(line) + len(piece) > max_record_bytes:
              over, line = (over or len(line)) + len(piece), bytearray()
            else:
              line += piece
            if nl < 0:
              break
            lines.append(over or bytes(line))
            line, over = bytearray(), 0
            start = nl + 1
    except (OSError, EOFError) as e:
      raise ValueError(f"data shard {path!r} is not a readable gzip file: {e}") from None
    if line or over:
      lines.append(over or bytes(line))
    self.lines = lines

  def __len__(self):
    return len(self.lines)

  def __getitem__(self, i):
    line = self.lines[i]
    if isinstance(line, int):
      return ("too_large", line, self.base_dir, f"{self.path}:{i + 1}")
    return ("json", line.rstrip(b"\r"), self.base_dir, f"{self.path}:{i + 1}")


class ParquetShard:
  """A Parquet file read one row group at a time (the last group read is kept)."""

  def __init__(self, path: str, max_record_bytes: int = MAX_RECORD_BYTES):
    del max_record_bytes  # a row is read with its row group; parse_record bounds its size
    import pyarrow.parquet as pq
    self.path = path
    self.base_dir = os.path.dirname(os.path.abspath(path))
    meta = pq.ParquetFile(path).metadata
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    self.group_starts = list(np.cumsum([0] + sizes))
    self._cached = (None, None)

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_cached"] = (None, None)
    return state

  def __len__(self):
    return int(self.group_starts[-1])

  def __getitem__(self, i):
    import pyarrow.parquet as pq
    g = bisect.bisect_right(self.group_starts, i) - 1
    if self._cached[0] != g:
      self._cached = (g, pq.ParquetFile(self.path).read_row_group(g).to_pylist())
    return ("row", self._cached[1][i - self.group_starts[g]], self.base_dir, f"{self.path}:{i + 1}")


class ArrayRecordShard:
  """An ArrayRecord file whose records are UTF-8 JSON objects (like JSONL lines)."""

  def __init__(self, path: str, max_record_bytes: int = MAX_RECORD_BYTES):
    del max_record_bytes  # records are read whole; parse_record bounds their size
    from grain.sources import ArrayRecordDataSource
    self.path = path
    self.base_dir = os.path.dirname(os.path.abspath(path))
    self._source = ArrayRecordDataSource([path])

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    return ("json", self._source[i], self.base_dir, f"{self.path}:{i + 1}")


_READERS = {".jsonl": JsonlShard, ".jsonl.gz": GzipJsonlShard, ".parquet": ParquetShard,
            ".array_record": ArrayRecordShard}


class ConcatSource:
  """Random access over the records of several shards, in shard order (a grain data source)."""

  def __init__(self, shards: Sequence, name: str):
    self.shards = list(shards)
    self.name = name
    self.offsets = list(np.cumsum([0] + [len(s) for s in self.shards]).tolist())

  def __len__(self):
    return self.offsets[-1]

  def __getitem__(self, i):
    if not 0 <= i < len(self):
      raise IndexError(i)
    s = bisect.bisect_right(self.offsets, i) - 1
    return self.shards[s][i - self.offsets[s]]

  def __repr__(self):
    return f"ConcatSource({self.name!r}, {len(self.shards)} shards, {len(self)} records)"


def open_source(paths: Sequence[str], name: str,
                max_record_bytes: int = MAX_RECORD_BYTES) -> ConcatSource:
  """One source over every record of the shards `paths` names (the config key `name`); errors
  name the bad path and the key."""
  files = expand_paths(paths, name)
  if not files:
    raise ValueError(f"data stream {name!r} has no sources")
  return ConcatSource([_READERS[shard_format(f)](f, max_record_bytes) for f in files], name)
