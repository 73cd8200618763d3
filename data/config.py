"""Defaults of the `data` section of every config (TRAINING.md §3).

`configs/common.base_config` installs them as `cfg.data`; a config file or a command-line
override (`--config.data.seq_len=4096`) changes them. Nothing here reads the model section.
"""

from __future__ import annotations


def data_defaults() -> dict:
  """The data section's fields and their default values."""
  return dict(
      seq_len=128,  # tokens per packed row
      batch_size=8,  # rows per batch yielded by the iterator (per process)
      # Token shares of the two streams (TRAINING.md §3: text : multimodal = 7 : 1 in tokens).
      text_weight=7.0,
      multimodal_weight=1.0,
      # Shard paths, directories or globs (.jsonl, .jsonl.gz, .parquet, .array_record).
      # Both empty (train and eval alike) = the built-in default corpus (stdlib + shapes).
      text_sources=(),
      multimodal_sources=(),
      text_eval_sources=(),
      multimodal_eval_sources=(),
      # A Hugging Face tokenizer.json; "" = byte-level BPE of model.vocab_size entries, trained
      # once on the default corpus and cached.
      tokenizer_path="",
      cache_dir="",  # "" = $DSV41_CACHE or ~/.cache/dsv41_jax (tokenizer, corpus manifest)
      # px; images are fitted into this box, then snapped to multiples of 42. Small by default:
      # every image slot of a batch is this size ([batch, max_images, 168, 168, 3] uint8), and
      # the generated shapes need no more; raise it for real photos.
      max_image_size=168,
      max_images_per_row=0,  # 0 = seq_len // 64 (at least 1); rows never hold more
      # Open bins of the best-fit packer. Few bins suffice (cuts fill the last gaps); more bins
      # delay documents longer, which skews the stream shares of the first rows.
      pool_bins=8,
      # Cut text pieces to fill rows exactly (data/packing.py). On: rows stay full and a cut
      # piece continues in a later row, each cut costing one target; the rate is logged as
      # `packer/cut_rate` (cuts per piece). Off: no piece is ever split, and the rows closed
      # with room left are padded (`padding_tokens`; more pool_bins lower it).
      packer_cuts=True,
      worker_count=0,  # grain worker processes per stream (0 = tokenize in the main process)
      worker_buffer_size=16,  # documents each worker keeps ready
      seed=0,
      # Default corpus: percentage of stdlib files held out for evaluation (by path hash),
      # and how many generated image-caption documents each split has.
      heldout_percent=3,
      image_docs_train=200_000,
      image_docs_eval=2_000,
  )
