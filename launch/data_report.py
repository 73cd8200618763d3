"""Run the data pipeline for N packed rows and report what it produced (docs/design.md §T3).

  python -m launch.data_report --config=configs/tiny.py --rows=1000
  python -m launch.data_report --config=configs/tiny.py --rows=1000 --json \
      --config.data.seq_len=4096
  python -m launch.data_report --config=configs/small.py:s3 --rows=160 --engram_ids \
      --config.data.batch_size=32 --config.data.seq_len=4096 --config.model.seq_len=4096

Figures (JSON keys), all over the first `ceil(rows / batch_size)` batches of process 0 of 1:

- `padding_fraction`: positions with `segment_ids == 0` / all positions;
- `multimodal_token_share`: non-padding tokens of multimodal-stream documents / all non-padding
  tokens (from the iterator's `row_tokens/<stream>` counters);
- `tokens_per_second`: row positions / wall-clock seconds of `next()`, steady state: from the
  second batch on (setup -- tokenizer, manifest -- and the first batch -- worker start-up, pool
  fill -- are reported apart as `setup_seconds`, `first_batch_seconds`);
- `skipped_records`: records skipped, in all, each time a pass reads one (`skipped_by_reason`
  splits it, `skipped_at` lists the first distinct `file:line` locations of each reason, and of
  `truncated_documents`);
- `truncated_documents`: documents cut at `data.max_document_tokens`;
- `segment_length`: the distribution of segment (document piece) lengths in the rows;
- `packer`: the packer's counters, among them `cut_rate` = cuts / pieces (pieces split across rows
  to fill them; 0 with `data.packer_cuts` off) and `early_closes` (rows closed with room left);
- `image_slots`: the rows' image slots (`data.max_images_per_row` a row) and how many hold an
  image: the mean a row, the share of rows with none and with every slot filled, and the count of
  rows by images held (what the ViT runs over; `vision.slot_budget` in docs/design.md §15.2).
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from launch import cli


def _define_flags():
  """Command-line flags, defined only when run as a program (tests import this module)."""
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
  flags.DEFINE_integer("rows", 1000, "Packed rows to produce.")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")
  flags.DEFINE_bool("engram_ids", False, "Also compute the model's Engram ids for every row, as "
                    "launch.train's pipeline does (the host's whole work per batch).")


def segment_lengths(batch: dict) -> np.ndarray:
  """Lengths of all segments (ids >= 1) of every row of a batch."""
  seg = batch["segment_ids"]
  out = []
  for row in seg:
    counts = np.bincount(row, minlength=int(row.max()) + 1)[1:]
    out.append(counts[counts > 0])
  return np.concatenate(out) if out else np.zeros(0, np.int64)


def report(cfg, rows: int, engram_ids: bool = False) -> dict:
  """Produce `rows` (rounded up to whole batches) and measure them; see the module docstring.
  With `engram_ids` (and a model with Engram) each batch also carries the model's Engram ids, the
  token features `launch.train` asks of the pipeline."""
  from data import pipeline
  from data.config import data_config
  t0 = time.perf_counter()
  data = data_config(cfg.data)
  vocab_size = cfg.model.vocab_size if "model" in cfg else None
  tok = pipeline.make_tokenizer(data, vocab_size)
  features = None
  if engram_ids and "model" in cfg:
    from launch import setup as setup_lib
    model = setup_lib.run_config(cfg, process_count=1).model
    cmap = setup_lib.compression_map(model, tok)
    features = setup_lib.EngramFeatures(model, cmap) if cmap is not None else None
  it = pipeline.make_train_iterator(data, 0, 1, tokenizer=tok, token_features=features,
                                    vocab_size=vocab_size)
  it.start_prefetch()
  setup = time.perf_counter() - t0
  n_batches = math.ceil(rows / data.batch_size)
  pad = positions = 0
  lengths, image_counts, slots = [], [], 0
  busy = first = 0.0
  for i in range(n_batches):
    t = time.perf_counter()
    batch = next(it)
    if i == 0:
      first = time.perf_counter() - t
    else:
      busy += time.perf_counter() - t
    pad += int((batch["segment_ids"] == 0).sum())
    positions += batch["segment_ids"].size
    lengths.append(segment_lengths(batch))
    if "image_count" in batch:
      image_counts.append(np.asarray(batch["image_count"]).reshape(-1))
      slots = batch["images"].shape[1]
  c = it.counters()
  skipped_at = it.skip_locations()
  it.close()
  seg = np.concatenate(lengths)
  text, mm = c.get("row_tokens/text", 0), c.get("row_tokens/multimodal", 0)
  skipped = {k.split("/", 1)[1]: v for k, v in c.items() if k.startswith("skipped/")}
  edges = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
  edges = [e for e in edges if e < data.seq_len] + [data.seq_len]
  hist = np.histogram(seg, bins=[0.5] + [e + 0.5 for e in edges])[0]  # (prev, e] per bin
  out = {
      "rows": n_batches * data.batch_size,
      "seq_len": data.seq_len,
      "batch_size": data.batch_size,
      "worker_count": data.worker_count,
      "engram_ids": features is not None,
      "padding_fraction": pad / positions,
      "multimodal_token_share": mm / max(1, text + mm),
      "tokens_per_second": (positions - batch["segment_ids"].size) / busy if busy else 0.0,
      "setup_seconds": setup,
      "first_batch_seconds": first,
      "skipped_records": sum(skipped.values()),
      "skipped_by_reason": skipped,
      "skipped_at": skipped_at,
      "truncated_documents": c.get(pipeline.TRUNCATED, 0),
      "segment_length": {
          "count": int(len(seg)), "mean": float(seg.mean()),
          "percentiles": {str(q): float(np.percentile(seg, q)) for q in (1, 10, 50, 90, 99)},
          "max": int(seg.max()), "full_rows": int((seg == data.seq_len).sum()),
          "histogram": {f"<={e}": int(h) for e, h in zip(edges, hist)},
      },
      "packer": {k.split("/", 1)[1]: v for k, v in c.items() if k.startswith("packer/")},
      "documents": {k.split("/", 1)[1]: v for k, v in c.items() if k.startswith("documents/")},
      "tokenizer": {"source": tok.source, "vocab_size": tok.vocab_size},
  }
  if image_counts:
    n = np.concatenate(image_counts)
    out["image_slots"] = {
        "per_row": int(slots), "mean_filled": float(n.mean()),
        "rows_without": float(np.mean(n == 0)), "rows_full": float(np.mean(n == slots)),
        "rows_by_images": np.bincount(n, minlength=slots + 1).tolist()}
  if not (data.text_sources or data.multimodal_sources):
    m = pipeline.default_manifest(data)
    out["corpus"] = {"python": m["python"]["version"], "manifest_hash": m["hash"][:16],
                     "stdlib_files": len(m["files"]), "text_bytes": m["text_bytes"]}
  return out


def format_text(r: dict) -> str:
  lines = [f"rows {r['rows']} x seq_len {r['seq_len']} (batch {r['batch_size']}, "
           f"workers {r['worker_count']}{', Engram ids' if r.get('engram_ids') else ''})",
           f"padding_fraction        {r['padding_fraction']:.3e}",
           f"multimodal_token_share  {r['multimodal_token_share']:.4f}",
           f"tokens_per_second       {r['tokens_per_second']:,.0f}  (setup {r['setup_seconds']:.1f} s, "
           f"first batch {r['first_batch_seconds']:.1f} s)",
           f"skipped_records         {r['skipped_records']}  {r['skipped_by_reason']}",
           f"truncated_documents     {r['truncated_documents']}  (cut at data.max_document_tokens)",
           *(f"  {reason:<22} at {', '.join(where)}" for reason, where in r["skipped_at"].items()),
           f"packer                  {r['packer']}",
           f"documents               {r['documents']}",
           f"tokenizer               {r['tokenizer']}"]
  if "corpus" in r:
    lines.append(f"corpus                  {r['corpus']}")
  if "image_slots" in r:
    i = r["image_slots"]
    lines.append(f"image slots             {i['per_row']} a row, {i['mean_filled']:.1f} filled on "
                 f"average; rows without images {i['rows_without']:.1%}, with every slot "
                 f"filled {i['rows_full']:.1%}; rows by images held {i['rows_by_images']}")
  s = r["segment_length"]
  lines.append(f"segment lengths: {s['count']} segments, mean {s['mean']:.1f}, max {s['max']}, "
               f"full rows {s['full_rows']}, percentiles {s['percentiles']}")
  peak = max(s["histogram"].values()) or 1
  for k, v in s["histogram"].items():
    lines.append(f"  {k:>8} {v:8d} {'#' * int(round(40 * v / peak))}")
  return "\n".join(lines)


def main(argv):
  del argv
  r = report(flags.FLAGS.config, flags.FLAGS.rows, flags.FLAGS.engram_ids)
  print(json.dumps(r, indent=1) if flags.FLAGS.json else format_text(r))


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=cli.parse_flags)
