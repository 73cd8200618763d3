"""A tiny model with the full structure (SWA, Full, Reuse, Reindex, Engram, CED) for CPU runs.

The README's main job, a short pre-training run on the embedded default corpus:

  python -m launch.train --config=configs/tiny.py --workdir=/tmp/dsv41_tiny
  python -m launch.ledger --config=configs/tiny.py

`configs/tiny.py:micro` is the micro model (`micro()`) of the launch tests, the ladder's launch
points and the memory plan's calibration:

  python -m launch.train --config=configs/tiny.py:micro --workdir=/tmp/dsv41_micro
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The tiny model; `arg` "micro": the micro model (`micro`)."""
  if arg == "micro":
    return micro()
  if arg:
    raise ValueError(f"configs/tiny.py takes no argument or 'micro', not {arg!r}")
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


def micro() -> ml_collections.ConfigDict:
  """A micro model (CSA Full layers, sliding window, indexer, MoE, Engram) for the launch tests.

  Two layers at 32 tokens, text only: small enough that one training compile stays cheap on CPU.
  MoE dispatch is "capacity" with capacity factor n_experts / k, so no token is ever dropped and
  the step is the same function of the batch on every mesh shape.
  """
  model = dict(
      vocab_size=512,
      hidden_size=32,
      num_hidden_layers=2,
      num_attention_heads=2,
      head_dim=16,
      qk_rope_head_dim=8,
      q_lora_rank=16,
      o_groups=1,
      o_lora_rank=16,
      sliding_window=8,
      # encoder: layer 0 Full + Engram (m = 2); decoder: layer 1 Full (m = 1).
      compress_ratios=(2, 1),
      kv_source_layer_ids=(0, 1),
      index_source_layer_ids=(0, 1),
      index_n_heads=2,
      index_head_dim=8,
      index_topk=4,
      candidate_source_layer_id=0,
      yarn_enabled=False,
      n_routed_experts=4,
      num_experts_per_tok=2,
      moe_intermediate_size=16,
      moe_dispatch="capacity",
      moe_capacity_factor=2.0,
      hc_mult=2,
      hc_sinkhorn_iters=4,
      engram_layer_ids=(0,),
      engram_n_heads=2,
      engram_head_dim=8,
      engram_vocab_size=101,
      engram_compressed_vocab_size=512,
      seq_len=32,
      dtype="float32",
  )
  cfg = common.base_config(model=model)
  cfg.data.seq_len = 32
  cfg.data.batch_size = 8
  cfg.data.multimodal_weight = 0.05  # text only model: image spans are plain tokens
  cfg.data.max_image_size = 42
  cfg.data.image_docs_train = 16
  cfg.data.image_docs_eval = 16
  cfg.train.steps = 4
  cfg.train.log_every = 1
  cfg.train.eval_every = 0
  cfg.train.checkpoint_every = 2
  cfg.train.keep_checkpoints = 10
  cfg.train.progress_bar = False
  cfg.optim.lr = 3e-3
  cfg.optim.warmup_steps = 1
  cfg.optim.schedule_unit = "steps"
  cfg.optim.decay_start = 2
  cfg.optim.decay_end = 4
  return cfg
