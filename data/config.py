"""The `data` section of every config (docs/design.md §T3): `DataConfig`, typed and validated.

`configs/common.base_config` installs `data_defaults()` as `cfg.data`; a config file or a
command-line override (`--config.data.seq_len=4096`) changes them, and `data_config(cfg.data)`
checks the result once: every error names the key (`data.batch_size=0 must be >= 1`). Nothing here
reads the model section.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

MIN_SEQ_LEN = 8
CELL_PX = 42  # one image cell (ViT patch 14 × pixel-unshuffle 3); data/images.py uses the same


class DataConfigError(ValueError):
  """A data section with an unknown key or a value the pipeline cannot honour."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The data section's fields, their defaults and their checks."""

  seq_len: int = 128  # tokens per packed row
  batch_size: int = 8  # rows per batch yielded by the iterator (per process)
  # Token shares of the two streams (docs/design.md §T3: text : multimodal = 7 : 1 in tokens).
  text_weight: float = 7.0
  multimodal_weight: float = 1.0
  # Shard paths, directories or globs (.jsonl, .jsonl.gz, .parquet, .array_record).
  # Both empty (train and eval alike) = the built-in default corpus (stdlib + shapes).
  text_sources: tuple = ()
  multimodal_sources: tuple = ()
  text_eval_sources: tuple = ()
  multimodal_eval_sources: tuple = ()
  # A Hugging Face tokenizer.json; "" = byte-level BPE of model.vocab_size entries, trained once
  # on the default corpus and cached.
  tokenizer_path: str = ""
  cache_dir: str = ""  # "" = $DSV41_CACHE or ~/.cache/dsv41_jax (tokenizer, corpus manifest)
  # px; images are fitted into this box, then snapped to multiples of 42. Small by default: every
  # image slot of a batch is this size ([batch, max_images, 168, 168, 3] uint8), and the
  # generated shapes need no more; raise it for real photos.
  max_image_size: int = 168
  max_images_per_row: int = 0  # 0 = seq_len // 64 (at least 1); rows never hold more
  # Bounds on one record, enforced before anything is decoded or tokenized (skipped records are
  # counted as `record_too_large` / `image_too_large`, with their file:line): a record's encoded
  # size in bytes (one JSONL line, Parquet row or ArrayRecord record; 64 MiB is far above any
  # document worth training on, and bounds the tokenizer's memory), and an image's pixel count
  # read from its header (50 Mpx admits any camera photo; a decompression bomb of a few KB can
  # claim billions).
  max_record_bytes: int = 64 * 2**20
  max_image_pixels: int = 50_000_000
  # Tokens of one document at most: a longer one is cut after its first max_document_tokens
  # tokens (text is tokenized in bounded chunks, so an outsized record costs memory and time for
  # the kept part only), counted as `truncated_documents` and named once per file:line in a
  # warning. 2^20 tokens (~4 MB of text) exceeds any row; a 50 MB single-line record otherwise
  # takes ~12 GB to tokenize.
  max_document_tokens: int = 2**20
  # Open bins of the best-fit packer. Few bins suffice (cuts fill the last gaps); more bins delay
  # documents longer, which skews the stream shares of the first rows.
  pool_bins: int = 8
  # Cut text pieces to fill rows exactly (data/packing.py). On: rows stay full and a cut piece
  # continues in a later row, each cut costing one target; the rate is logged as
  # `packer/cut_rate` (cuts per piece). Off: no piece is ever split, and the rows closed with room
  # left are padded (`padding_tokens`; more pool_bins lower it).
  packer_cuts: bool = True
  worker_count: int = 0  # grain worker processes per stream (0 = tokenize in the main process)
  worker_buffer_size: int = 16  # documents each worker keeps ready
  seed: int = 0
  # Default corpus: percentage of stdlib files held out for evaluation (by path hash), and how
  # many generated image-caption documents each split has.
  heldout_percent: int = 3
  image_docs_train: int = 200_000
  image_docs_eval: int = 2_000

  def __post_init__(self):
    for name in ("text_sources", "multimodal_sources", "text_eval_sources",
                 "multimodal_eval_sources"):
      value = getattr(self, name)
      object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
    errors = []

    def need(cond, msg):
      if not cond:
        errors.append(msg)

    for name in ("text_weight", "multimodal_weight"):
      w = getattr(self, name)
      need(isinstance(w, (int, float)) and math.isfinite(w) and w > 0,
           f"mixture weight data.{name}={w!r} must be a finite number > 0")
    need(self.seq_len >= MIN_SEQ_LEN, f"data.seq_len={self.seq_len} must be >= {MIN_SEQ_LEN}")
    need(self.batch_size >= 1, f"data.batch_size={self.batch_size} must be >= 1 (rows per batch "
         "per process)")
    need(self.max_image_size >= CELL_PX,
         f"data.max_image_size={self.max_image_size} is below one {CELL_PX}-px cell")
    if self.max_image_size >= CELL_PX and self.seq_len >= MIN_SEQ_LEN:
      block = (self.max_image_size // CELL_PX) ** 2 + 2
      need(block <= self.seq_len, f"data.max_image_size={self.max_image_size} gives image blocks "
           f"of {block} tokens, more than data.seq_len={self.seq_len}")
    need(self.max_images_per_row >= 0,
         f"data.max_images_per_row={self.max_images_per_row} must be >= 0 (0 = seq_len // 64)")
    need(self.max_record_bytes >= 1,
         f"data.max_record_bytes={self.max_record_bytes} must be >= 1")
    need(self.max_document_tokens >= 2,
         f"data.max_document_tokens={self.max_document_tokens} must be >= 2 (begin and end)")
    need(self.max_image_pixels >= CELL_PX * CELL_PX,
         f"data.max_image_pixels={self.max_image_pixels} must admit one {CELL_PX}-px cell")
    need(self.pool_bins >= 1, f"data.pool_bins={self.pool_bins} must be >= 1")
    need(self.worker_count >= 0, f"data.worker_count={self.worker_count} must be >= 0")
    need(self.worker_buffer_size >= 1,
         f"data.worker_buffer_size={self.worker_buffer_size} must be >= 1")
    need(0 <= self.heldout_percent <= 100,
         f"data.heldout_percent={self.heldout_percent} must lie in [0, 100]")
    if errors:
      raise DataConfigError("; ".join(errors))


def images_per_row(seq_len: int, max_images_per_row: int) -> int:
  """Image slots of a packed row: `data.max_images_per_row`, or seq_len // 64 (at least 1)."""
  return max_images_per_row or max(1, seq_len // 64)


def data_defaults() -> dict:
  """The data section's fields and their default values (the `cfg.data` section)."""
  return dataclasses.asdict(DataConfig())


def data_config(values: Mapping[str, Any]) -> DataConfig:
  """A checked `DataConfig` from a dict or ConfigDict; unknown keys are an error naming them."""
  values = dict(values)
  known = {f.name for f in dataclasses.fields(DataConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise DataConfigError(f"data has unknown keys {unknown}; known keys are {sorted(known)}")
  return DataConfig(**values)
