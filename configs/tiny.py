"""A tiny model with the full structure (SWA, Full, Reuse, Reindex, Engram, CED) for CPU runs.

The README's main job, a short pre-training run on the embedded default corpus:

  python -m launch.train --config=configs/tiny.py --workdir=/tmp/dsv41_tiny
  python -m launch.ledger --config=configs/tiny.py
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  model = dict(
      vocab_size=2048,
      hidden_size=64,
      num_hidden_layers=12,
      num_attention_heads=4,
      head_dim=32,
      qk_rope_head_dim=16,
      q_lora_rank=32,
      o_groups=2,
      o_lora_rank=32,
      sliding_window=16,
      # encoder 0-5: SWA, SWA+Engram, Full, Reuse, Full+Engram, Reuse (m = 2);
      # decoder 6-11: Full, Reuse, Reindex, Reuse, Reindex, Reuse (m = 1).
      compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1),
      kv_source_layer_ids=(2, 4, 6),
      index_source_layer_ids=(2, 4, 6, 8, 10),
      index_n_heads=2,
      index_head_dim=32,  # one MXFP4 block of 32 for the indexer-key cache layout
      index_topk=8,
      candidate_source_layer_id=6,
      candidate_topk_blocks=4,
      candidate_block_size=2,
      yarn_enabled=False,  # pre-training phase: plain RoPE (docs/design.md §4.5)
      n_routed_experts=8,
      num_experts_per_tok=2,
      moe_intermediate_size=32,
      hc_mult=4,
      engram_layer_ids=(1, 4),
      engram_n_heads=2,
      engram_head_dim=16,
      engram_vocab_size=1009,  # small tables: the prime search starts here
      engram_compressed_vocab_size=2048,
      seq_len=128,
      dtype="float32",
      # On CPU, XLA's ragged_dot is ~16x slower than capacity buffers with batched einsums
      # (benchmarks/RESULTS.md, MoE dispatch). Capacity factor E / k = 4 makes every buffer hold
      # all tokens, so nothing is ever dropped: the exact dropless function at einsum speed.
      moe_dispatch="capacity",
      moe_capacity_factor=4.0,
      # A 2-layer ViT on the data's 168-px canvas (4 × 4 cells of 42 px: 12 × 12 patches).
      vision=dict(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128,
                  projector_hidden=128, max_image_size=168),
  )
  cfg = common.base_config(model=model)
  cfg.data.seq_len = 128  # the tiny model's seq_len
  cfg.data.batch_size = 8
  # A short CPU run: warm up, hold to 60 % of the steps, cosine-decay to the end (the report's
  # shape in miniature). The decay window is a fraction of train.steps, so a shorter run
  # (--config.train.steps=50) still decays, over its own last 40 %.
  cfg.train.steps = 300
  cfg.train.eval_every = 100
  cfg.train.checkpoint_every = 100
  cfg.optim.lr = 3e-3
  cfg.optim.warmup_steps = 20
  cfg.optim.schedule_unit = "fraction"
  cfg.optim.decay_start = 0.6
  cfg.optim.decay_end = 1.0
  return cfg
