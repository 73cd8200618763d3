"""The DSpark drafter stage (docs/design.md §16.2): a drafter trained on a frozen backbone.

  python -m launch.train_drafter --config=configs/dspark.py --backbone=/tmp/dsv41_tiny \
      --workdir=/tmp/dsv41_tiny_drafter
  python -m launch.generate --workdir=/tmp/dsv41_tiny --speculative \
      --drafter=/tmp/dsv41_tiny_drafter --prompt="The river" --temperature=0

The drafter's width and vocabulary are the backbone's (0 = take them from the backbone's
config.json; a value that differs from it is an error naming the field). The report fixes 3 blocks,
a 128-token window and 5 draft positions; the rest are our choices (docs/design.md §16.6).
The data is the backbone's own training stream (its config.json's data section).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  cfg = ml_collections.ConfigDict()
  cfg.drafter = ml_collections.ConfigDict(dict(
      hidden_size=0, vocab_size=0,          # 0 = the backbone's
      num_layers=3, sliding_window=128, draft_len=5,
      num_heads=4, mlp_ratio=4, markov_rank=64, confidence_width=64,
      rope_theta=10000.0, rms_norm_eps=1e-6, dtype="float32"))
  cfg.train = ml_collections.ConfigDict(dict(
      steps=300, batch_size=8, seed=0,
      # AdamW, linear warm-up then cosine to 10 %: the drafter is small and trains fast.
      lr=3e-3, warmup_steps=20, weight_decay=0.01,
      confidence_weight=1.0,                # weight of the confidence BCE beside the draft loss
      log_every=10, checkpoint_every=100, keep_checkpoints=2))
  return cfg
