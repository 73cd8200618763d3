"""The drafter's configuration (docs/design.md §16.1; shared/spec/SOURCES.md, "DSpark").

From the report: 3 Transformer blocks, a 128-token sliding window, base logits for 5 draft
positions in one pass, a lightweight Markov head and a confidence head. The widths are ours
(docs/design.md §16.6 lists them as choices): the drafter runs at the backbone's hidden size (it reads
the backbone's final hidden state and its embedding, and its base logits go through the backbone's
own output head), with `num_heads` heads of `hidden_size / num_heads` and a SwiGLU MLP of
`mlp_ratio` × the width.
"""

from __future__ import annotations

import dataclasses


class DrafterConfigError(ValueError):
  """A drafter setting that cannot work; the message names the field."""


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  hidden_size: int              # the backbone's hidden size D
  vocab_size: int               # the backbone's vocabulary V
  num_layers: int = 3           # [SEED] 3 Transformer blocks
  sliding_window: int = 128     # [SEED] context rows each row and each draft query reads
  draft_len: int = 5            # [SEED] draft positions K per pass
  num_heads: int = 4
  mlp_ratio: int = 4
  markov_rank: int = 64         # the Markov head's bigram factorisation rank
  confidence_width: int = 64    # the confidence head's hidden width
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  dtype: str = "float32"

  def __post_init__(self):
    for name in ("hidden_size", "vocab_size", "num_layers", "sliding_window", "draft_len",
                 "num_heads", "mlp_ratio", "markov_rank", "confidence_width"):
      if int(getattr(self, name)) < 1:
        raise DrafterConfigError(f"drafter.{name}={getattr(self, name)} must be >= 1")
    if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
      raise DrafterConfigError(
          f"drafter.hidden_size={self.hidden_size} must split into drafter.num_heads="
          f"{self.num_heads} heads of an even width (RoPE rotates channel pairs)")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads
