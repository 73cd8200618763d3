"""A micro model (CSA Full layers, sliding window, indexer, MoE, Engram) for the launch tests.

Two layers at 32 tokens, text only: small enough that one training compile stays cheap on CPU.
MoE dispatch is "capacity" with capacity factor n_experts / k, so no token is ever dropped and the
step is the same function of the batch on every mesh shape.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
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
