"""Full-size DeepSeek-V4.1-Flash (MODEL.md §1).

  python -m launch.ledger --config=configs/flash.py
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  # Every model field at its ModelConfig default: the released V4.1-Flash configuration, with the
  # full vision tower (VisionConfig defaults: 32-layer ViT, width 1024, projector hidden 5120).
  return common.base_config(model={"vision": {}})
