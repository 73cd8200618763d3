"""Record and image bounds (data.max_record_bytes, data.max_image_pixels; issue 11 item 4).

A 200 MB JSONL line (a sparse hole in the file: no 200 MB is written to disk) and a 121-Mpx
1-bit PNG of a few KB are skipped before anything is decoded or tokenized, counted by reason,
located by file:line, with bounded memory: Python-side allocations (tracemalloc, which numpy
reports to) for the JSONL, the process's peak resident size for the PNG (Pillow's buffers are
not traced).
"""

import base64
import gzip
import json
import os
import struct
import subprocess
import sys
import tracemalloc
import zlib

import numpy as np
import pytest

from data import documents, images, pipeline, records, sources
from data.config import DataConfigError, data_config, data_defaults
from tests.data.conftest import make_data, mm_record, random_text, text_records, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HUGE = 200 * 10**6
MiB = 2**20


def bomb_png(side: int = 11_000) -> bytes:
  """A valid 1-bit PNG of side × side black pixels (121 Mpx at 11 000), compressed in a stream
  (the pixels are never held in memory: ~15 MB of zero rows deflate to ~15 KB)."""
  def chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
  z = zlib.compressobj(9)
  row = b"\0" * (1 + (side + 7) // 8)  # filter byte 0, then the packed bits
  idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
  ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit, grayscale
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def jsonl_with_huge_line(path: str, before, after) -> int:
  """JSONL: `before` records, one HUGE-byte line (a sparse hole of NUL bytes), `after` records.
  Returns the huge line's 1-based number."""
  with open(path, "wb") as f:
    for r in before:
      f.write(json.dumps(r).encode() + b"\n")
    f.seek(f.tell() + HUGE)
    f.write(b"\n")
    for r in after:
      f.write(json.dumps(r).encode() + b"\n")
  return len(before) + 1


def test_the_bomb_png_is_what_it_claims():
  from PIL import Image
  import io
  data = bomb_png()
  assert len(data) < 64 * 1024
  with pytest.warns(Image.DecompressionBombWarning):  # PIL's own alarm: 121 Mpx > its 89.5 Mpx
    img = Image.open(io.BytesIO(data))
  assert (img.mode, img.size) == ("1", (11_000, 11_000))
  small = Image.open(io.BytesIO(bomb_png(100)))
  small.load()
  assert small.getextrema() == (0, 0)  # decodes: a real PNG, not a header alone


def test_image_pixel_bound_is_checked_before_decoding(tmp_path):
  """The 121-Mpx PNG is rejected as image_too_large while the process's peak RSS grows by less
  than 20 MB (decoding it would take >= 121 MB for the 8-bit pixel buffer alone); an image just
  under the bound still loads."""
  path = tmp_path / "bomb.png"
  path.write_bytes(bomb_png())
  code = f"""
import resource
from data import images
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
  images.load_image(open({str(path)!r}, 'rb').read(), None, 168)
  print('loaded')
except images.ImageRejected as e:
  print(e.reason, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
  reason, grew_kb = out.stdout.split()
  assert reason == "image_too_large", out.stdout + out.stderr
  assert int(grew_kb) < 20 * 1024, grew_kb
  assert images.load_image(bomb_png(100), None, 168, max_pixels=100 * 100).shape == (84, 84, 3)
  with pytest.raises(images.ImageRejected) as e:
    images.load_image(bomb_png(100), None, 168, max_pixels=100 * 100 - 1)
  assert e.value.reason == "image_too_large" and "data.max_image_pixels" in str(e.value)
  with pytest.raises(images.ImageRejected) as e:  # an image file past the byte bound: not read
    images.load_image(None, str(path), 168, max_file_bytes=1000)
  assert e.value.reason == "image_too_large"


@pytest.mark.parametrize("gz", [False, True])
def test_huge_jsonl_line_is_skipped_with_bounded_memory(tmp_path, gz):
  """The 200 MB line's payload is `too_large` (never read); the neighbouring records read as
  written; Python allocations while indexing and reading stay under 8 MiB."""
  good = text_records(3, 4)
  path = str(tmp_path / "big.jsonl")
  line = jsonl_with_huge_line(path, good[:2], good[2:])
  if gz:
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=1) as dst:
      while chunk := src.read(16 * MiB):
        dst.write(chunk)
    path += ".gz"
  tracemalloc.start()
  try:
    src = sources.open_source([path], "data.text_sources", max_record_bytes=MiB)
    payloads = [src[i] for i in range(len(src))]
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 8 * MiB, peak
  assert len(payloads) == 5
  assert payloads[line - 1][0] == "too_large" and payloads[line - 1][1] == HUGE
  assert payloads[line - 1][3] == f"{path}:{line}"
  with pytest.raises(records.RecordSkipped) as e:
    records.parse_record(payloads[line - 1])
  assert e.value.reason == "record_too_large"
  rest = [records.parse_record(p) for i, p in enumerate(payloads) if i != line - 1]
  assert rest == [[("text", r["text"])] for r in good]


def test_pipeline_counts_and_locates_skips(tmp_path, corpus_dir, small_tok):
  """One held-out pass over a text shard with the 200 MB line and a multimodal shard with the
  bomb PNG at line 2: each is skipped once, counted under its reason, located by file:line (also
  after a state round trip)."""
  text = str(tmp_path / "text.jsonl")
  line = jsonl_with_huge_line(text, text_records(5, 3), text_records(6, 3))
  mm = [mm_record(i, "eval") for i in range(6)]
  mm[1] = {"segments": [{"text": "a bomb"},
                        {"image_base64": base64.b64encode(bomb_png()).decode()}]}
  mm_path = write_jsonl(tmp_path / "mm.jsonl", mm)
  cfg = make_data(corpus_dir, text_eval_sources=(text,), multimodal_eval_sources=(mm_path,),
                 max_record_bytes=MiB)
  it = pipeline.make_eval_iterator(cfg, tokenizer=small_tok)
  list(it)
  c = it.counters()
  assert c["skipped/record_too_large"] == 1 and c["skipped/image_too_large"] == 1
  assert sum(v for k, v in c.items() if k.startswith("skipped/")) == 2
  assert it.skip_locations() == {"image_too_large": [f"{mm_path}:2"],
                                 "record_too_large": [f"{text}:{line}"]}
  it2 = pipeline.make_eval_iterator(cfg, tokenizer=small_tok)
  it2.set_state(json.loads(json.dumps(it.get_state())))
  assert it2.skip_locations() == it.skip_locations()


def test_data_config_names_the_key():
  assert data_config(data_defaults()).max_record_bytes == 64 * MiB
  for key, value, text in (("batch_size", 0, "data.batch_size=0 must be >= 1"),
                           ("max_record_bytes", 0, "data.max_record_bytes=0"),
                           ("max_image_pixels", 10, "data.max_image_pixels=10"),
                           ("text_weight", -1.0, "data.text_weight=-1.0"),
                           ("seq_len", 4, "data.seq_len=4")):
    with pytest.raises(DataConfigError, match=text.replace(".", r"\.")):
      data_config({**data_defaults(), key: value})
  with pytest.raises(DataConfigError, match="unknown keys"):
    data_config({**data_defaults(), "batchsize": 3})


def test_outsized_document_is_cut_with_a_warning_and_bounded_work(tmp_path, corpus_dir, small_tok,
                                                                  caplog):
  """A 4 MB single-line document (under max_record_bytes, as in issue 33's 50 MB case) with
  data.max_document_tokens = 3000: one held-out pass cuts it to 3000 tokens (counted, warned once
  naming its file:line), keeps every other record whole, and hands the tokenizer at most
  `ENCODE_CHUNK` characters at a time and about 4 × 3000 in all (not 4 MB)."""
  rng = np.random.default_rng(7)
  big = {"text": "\n".join(random_text(rng, 12) for _ in range(65_000))}
  assert len(big["text"]) > 4 * 10**6
  others = text_records(8, 2) + text_records(9, 2)
  text = write_jsonl(tmp_path / "text.jsonl", others[:2] + [big] + others[2:])
  cfg = make_data(corpus_dir, text_eval_sources=(text,), max_document_tokens=3000)
  calls = []
  real = small_tok._tok

  class Spy:
    def __getattr__(self, name):
      return getattr(real, name)

    def encode(self, s, **kw):
      calls.append(len(s))
      return real.encode(s, **kw)
  small_tok._tok = Spy()
  try:
    with caplog.at_level("WARNING", logger="dsv41.data"):
      it = pipeline.make_eval_iterator(cfg, tokenizer=small_tok)
      batches = list(it)
  finally:
    small_tok._tok = real
  assert max(calls) <= 4 * 10**5 and sum(calls) < 10**5, (max(calls), sum(calls))
  c = it.counters()
  assert c[pipeline.TRUNCATED] == 1 and c["documents/text"] == 5
  warned = [r.getMessage() for r in caplog.records if "max_document_tokens" in r.getMessage()]
  assert len(warned) == 1 and f"{text}:3" in warned[0], warned
  assert it.skip_locations() == {pipeline.TRUNCATED: [f"{text}:3"]}
  tokens = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
  whole = sum(len(documents.build_document([("text", r["text"])], small_tok, 168)) for r in others)
  assert c["row_tokens/text"] == 3000 + whole
  assert tokens == c["row_tokens/text"] + c["row_tokens/multimodal"]


def test_encode_prefix_is_the_encoding_prefix(small_tok):
  """Below the limit `encode_prefix` is `encode`; above it, chunked at line breaks, it gives the
  whole text's first tokens (this tokenizer splits words at spaces and line breaks alike)."""
  rng = np.random.default_rng(3)
  short = random_text(rng, 50)
  ids, complete = small_tok.encode_prefix(short, 10_000)
  assert complete and ids.tolist() == small_tok.encode(short).tolist()
  long = "\n".join(random_text(rng, 9) for _ in range(4000))
  whole = small_tok.encode(long)
  for limit in (700, 5000, len(whole) - 1):
    ids, complete = small_tok.encode_prefix(long, limit)
    assert not complete and ids.tolist() == whole[:limit].tolist(), limit
  ids, complete = small_tok.encode_prefix(long, len(whole))
  assert complete and ids.tolist() == whole.tolist()
  assert 4 * 700 < len(long)  # so the shorter prefixes came from several chunks
