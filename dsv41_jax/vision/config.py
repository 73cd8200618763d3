"""Vision pathway hyper-parameters (docs/design.md §15, §15.1).

The report's ViT: 32 layers, width 1024, 16 heads, patch 14, 2-D RoPE, RMSNorm + SwiGLU; a 3 × 3
pixel-unshuffle, then a 2-layer MLP projector (hidden 5120) to the LM width; inputs up to about
1344 × 1344 px. One LM token covers one *cell* of `patch_size · unshuffle` = 42 px a side, the cell
the data pipeline sizes images in (`data/images.py`).
"""

from __future__ import annotations

import dataclasses

from dsv41_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """ViT encoder + projector; defaults are the full V4.1-Flash vision tower."""

  patch_size: int = 14
  unshuffle: int = 3            # pixel-unshuffle factor per side: unshuffle² patches per LM token
  num_layers: int = 32
  hidden_size: int = 1024
  num_heads: int = 16
  # SwiGLU width of the ViT MLP. The report gives none; 4 × width is the usual ViT ratio.
  intermediate_size: int = 4096
  projector_hidden: int = 5120
  max_image_size: int = 1344    # px per side, a multiple of patch_size · unshuffle
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  # The ViT's pixel normalisation: x = pixel / 127.5 − 1, so inputs lie in [−1, 1].
  scan_layers: bool = True
  remat: bool = True
  # Image slots the ViT runs on. A packed row has `data.max_images_per_row` slots (seq_len // 64 by
  # default: 64 at 4,096 tokens), and the first `image_count` hold images: at s3 ~15 of 64 a row on
  # the default corpus, 54 % of rows none, 7 % all 64. 0: every slot (empty ones too). n > 0: the
  # filled slots of each batch shard's rows gathered into n slots a row, the ViT and projector on
  # those, every slot when a shard holds more (`lax.switch` on the fullest shard's count; at s3's 4
  # rows with n = 24: ~19 % of micro-batches, ~50 % of the slots saved on average). The same
  # embeddings up to float rounding (`dsv41_jax/vision/pathway.py`).
  slot_budget: int = 0

  def __post_init__(self):
    errors = []

    def need(cond, msg):
      if not cond:
        errors.append(msg)

    for name in ("patch_size", "unshuffle", "num_layers", "hidden_size", "num_heads",
                 "intermediate_size", "projector_hidden", "max_image_size"):
      need(getattr(self, name) > 0, f"vision.{name} must be positive (got {getattr(self, name)})")
    if errors:
      raise ConfigError("; ".join(errors))
    need(self.hidden_size % self.num_heads == 0,
         f"vision.hidden_size ({self.hidden_size}) is not divisible by vision.num_heads "
         f"({self.num_heads})")
    need(self.head_dim % 4 == 0,
         f"vision head_dim ({self.hidden_size}/{self.num_heads}) must be a multiple of 4: 2-D RoPE "
         "rotates one half by the patch row and the other by the column, in channel pairs")
    need(self.max_image_size % self.cell_px == 0,
         f"vision.max_image_size ({self.max_image_size}) must be a multiple of the "
         f"{self.cell_px}-px cell (patch_size {self.patch_size} × unshuffle {self.unshuffle})")
    need(self.rope_theta > 0, f"vision.rope_theta must be positive (got {self.rope_theta})")
    need(self.slot_budget >= 0,
         f"vision.slot_budget must be 0 (every slot) or positive (got {self.slot_budget})")
    need(self.rms_norm_eps > 0, f"vision.rms_norm_eps must be positive (got {self.rms_norm_eps})")
    if errors:
      raise ConfigError("; ".join(errors))

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def cell_px(self) -> int:
    """Pixels per side of one LM image token (patch_size · unshuffle = 42)."""
    return self.patch_size * self.unshuffle

  @property
  def patch_dim(self) -> int:
    """Inputs of the linear patch embedding: patch_size² RGB values."""
    return self.patch_size * self.patch_size * 3

  @property
  def max_cells(self) -> int:
    return self.max_image_size // self.cell_px

  def replace(self, **changes) -> "VisionConfig":
    return dataclasses.replace(self, **changes)
