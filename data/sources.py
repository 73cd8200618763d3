"""Shard readers: JSONL (plain or gzipped), Parquet and ArrayRecord as grain data sources
(TRAINING.md §3).

`open_source(paths)` expands files, directories (their shards, sorted) and globs into an ordered
list of shards and returns one random-access source over all their records; each element is a
payload `(kind, value, base_dir)` for `records.parse_record`. A path that does not exist or a
shard of an unknown format raises here, naming it. Records are read on demand, so a source is
cheap to pickle into grain worker processes (gzipped JSONL is the exception: it is decompressed
into memory once, as gzip has no random access).
"""

from __future__ import annotations

import bisect
import glob
import gzip
import os
from typing import Sequence

import numpy as np

SHARD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".array_record")


def shard_format(path: str) -> str:
  for suffix in SHARD_SUFFIXES:
    if path.endswith(suffix):
      return suffix
  raise ValueError(f"data shard {path!r} has an unknown format (expected one of {SHARD_SUFFIXES})")


def expand_paths(paths: Sequence[str]) -> list[str]:
  """Shard files named by `paths` (files, directories, globs), in a fixed order."""
  out = []
  for p in paths:
    if any(c in p for c in "*?["):
      matches = sorted(glob.glob(p))
      if not matches:
        raise FileNotFoundError(f"data source glob {p!r} matches no file")
    elif os.path.isdir(p):
      matches = sorted(os.path.join(p, f) for f in os.listdir(p)
                       if any(f.endswith(s) for s in SHARD_SUFFIXES))
      if not matches:
        raise FileNotFoundError(f"data source directory {p!r} holds no shard {SHARD_SUFFIXES}")
    elif os.path.exists(p):
      matches = [p]
    else:
      raise FileNotFoundError(f"data source {p!r} does not exist")
    for m in matches:
      shard_format(m)
    out.extend(matches)
  return out


class JsonlShard:
  """One JSONL file; line offsets are indexed once, lines are read on demand."""

  def __init__(self, path: str):
    self.path = path
    self.base_dir = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
      data = f.read()
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate([[0], newlines + 1])
    stops = np.concatenate([newlines, [len(data)]])
    if len(data) and data.endswith(b"\n"):
      starts, stops = starts[:-1], stops[:-1]
    elif not len(data):
      starts, stops = starts[:0], stops[:0]
    self.starts = starts.astype(np.int64)
    self.stops = stops.astype(np.int64)

  def __len__(self):
    return len(self.starts)

  def __getitem__(self, i):
    with open(self.path, "rb") as f:
      f.seek(int(self.starts[i]))
      line = f.read(int(self.stops[i] - self.starts[i]))
    return ("json", line.rstrip(b"\r"), self.base_dir)


class GzipJsonlShard:
  """A gzipped JSONL file, decompressed into memory once."""

  def __init__(self, path: str):
    self.path = path
    self.base_dir = os.path.dirname(os.path.abspath(path))
    try:
      with gzip.open(path, "rb") as f:
        data = f.read()
    except (OSError, EOFError) as e:
      raise ValueError(f"data shard {path!r} is not a readable gzip file: {e}") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
      lines.pop()
    self.lines = lines

  def __len__(self):
    return len(self.lines)

  def __getitem__(self, i):
    return ("json", self.lines[i].rstrip(b"\r"), self.base_dir)


class ParquetShard:
  """A Parquet file read one row group at a time (the last group read is kept)."""

  def __init__(self, path: str):
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
    return ("row", self._cached[1][i - self.group_starts[g]], self.base_dir)


class ArrayRecordShard:
  """An ArrayRecord file whose records are UTF-8 JSON objects (like JSONL lines)."""

  def __init__(self, path: str):
    from grain.sources import ArrayRecordDataSource
    self.path = path
    self.base_dir = os.path.dirname(os.path.abspath(path))
    self._source = ArrayRecordDataSource([path])

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    return ("json", self._source[i], self.base_dir)


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


def open_source(paths: Sequence[str], name: str) -> ConcatSource:
  """One source over every record of the shards `paths` names; errors name the bad path."""
  files = expand_paths(paths)
  if not files:
    raise ValueError(f"data stream {name!r} has no sources")
  return ConcatSource([_READERS[shard_format(f)](f) for f in files], name)
