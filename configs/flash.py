"""Full-size DeepSeek-V4.1-Flash (docs/design.md §1), in its pre-training or long-context phase.

  python -m launch.ledger --config=configs/flash.py         # pre-training: plain RoPE
  python -m launch.ledger --config=configs/flash.py:long    # long-context extension: YaRN

Pre-training runs at 64K tokens until the 1M extension at 34T tokens, so it uses plain RoPE with
θ = 160000 on the compressed layers; YaRN (factor 16 from the original 65536) belongs to the
long-context phase, whose state is the released config (docs/design.md §4.5).
"""

import ml_collections

from configs import common

PHASES = ("pretrain", "long")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: "pretrain" (the default) or "long"."""
  phase = arg or "pretrain"
  if phase not in PHASES:
    raise ValueError(f"configs/flash.py:{arg}: unknown phase (choose one of {PHASES})")
  # Every other model field at its ModelConfig default: the released V4.1-Flash configuration,
  # with the full vision tower (VisionConfig defaults: 32-layer ViT, width 1024, projector hidden
  # 5120).
  return common.base_config(model={"vision": {}, "yarn_enabled": phase == "long"})
