"""Tests of data/sources.py and data/records.py: shard formats, errors, record parsing."""

import base64
import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import records, sources


def sample_records(rng, n):
  out = []
  for i in range(n):
    if rng.random() < 0.5:
      out.append({"text": f"record {i} " + "x" * int(rng.integers(0, 50))})
    else:
      out.append({"segments": [{"text": f"caption {i}"}, {"image": f"img{i}.png"}]})
  return out


def test_all_formats_yield_the_same_records(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter
  rng = np.random.default_rng(0)
  recs = sample_records(rng, 37)
  lines = [json.dumps(r).encode() for r in recs]
  (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines[:20]) + b"\n")
  (tmp_path / "b.jsonl").write_bytes(b"\n".join(lines[20:]))  # no final newline
  with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
    f.write(b"\n".join(lines) + b"\n")
  w = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
  for line in lines:
    w.write(line)
  w.close()
  rows = [{"text": r.get("text"), "segments": r.get("segments")} for r in recs]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "e.parquet", row_group_size=8)

  def parsed(src):
    return [records.parse_record(src[i]) for i in range(len(src))]

  expect = [records.from_object(r, str(tmp_path)) for r in recs]
  jsonl = sources.open_source([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "t")
  assert parsed(jsonl) == expect
  for name in ("c.jsonl.gz", "d.array_record", "e.parquet"):
    assert parsed(sources.open_source([str(tmp_path / name)], "t")) == expect, name
  # a directory expands to its shards in sorted order
  assert len(sources.open_source([str(tmp_path)], "t")) == 4 * 37


def test_paths_and_formats_are_checked(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    sources.open_source([str(tmp_path / "nope.jsonl")], "t")
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="x.csv.*unknown format"):
    sources.open_source([str(tmp_path / "x.csv")], "t")
  with pytest.raises(FileNotFoundError, match=r"\*.parquet"):
    sources.open_source([str(tmp_path / "*.parquet")], "t")
  with pytest.raises(ValueError, match="no sources"):
    sources.open_source([], "t")


def test_malformed_records_are_named():
  cases = [
      (b'{"text": "ok"', "malformed_json"),
      (b"\xff\xfe not utf8", "invalid_utf8"),
      (b'{"text": ""}', "empty_text"),
      (b'{"text": "   \\n"}', "empty_text"),
      (b"   ", "empty_text"),
      (b'[1, 2]', "malformed_record"),
      (b'{"title": "no text"}', "malformed_record"),
      (b'{"text": 5}', "malformed_record"),
      (b'{"segments": [{"text": "a", "image": "b.png"}]}', "malformed_record"),
      (b'{"segments": [{"image_base64": "***"}]}', "malformed_record"),
      (b'{"segments": []}', "empty_text"),
  ]
  for line, reason in cases:
    with pytest.raises(records.RecordSkipped) as e:
      records.parse_record(("json", line, None))
    assert e.value.reason == reason, line
  with pytest.raises(records.RecordSkipped) as e:
    records.parse_record(("text", b"\xc3\x28", None))
  assert e.value.reason == "invalid_utf8"


def test_segments_resolve_paths_and_bytes(tmp_path):
  payload = json.dumps({"segments": [
      {"text": "look:"}, {"image": "a/b.png"}, {"image": "/abs/c.png"},
      {"image_base64": base64.b64encode(b"\x89PNG").decode()}]}).encode()
  segs = records.parse_record(("json", payload, str(tmp_path)))
  assert segs == [("text", "look:"), ("image", None, os.path.join(str(tmp_path), "a/b.png")),
                  ("image", None, "/abs/c.png"), ("image", b"\x89PNG", None)]
