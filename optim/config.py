"""Optimizer hyper-parameters (docs/design.md §T2): one frozen dataclass, built from the config tree.

`optim_defaults()` is the plain dict that `configs/common.py` puts under `cfg.optim`;
`optim_config(d)` turns such a dict (or ConfigDict) back into an `OptimConfig`, rejecting unknown
keys by name. The defaults are the report's values (docs/design.md §11).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from optim.muon import NS_SCHEDULES
from optim.sinkhorn import STAT_DTYPES
from pallas_kernels import dispatch


class OptimConfigError(ValueError):
  """An optimizer configuration that is unknown or inconsistent; the message names the fields."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Everything the optimizer chain and the MoE bias update read."""

  # --- learning-rate schedule (schedule.py): warm-up, hold, cosine decay, hold ---
  lr: float = 2.6e-4                # peak learning rate
  warmup_steps: int = 2000          # linear warm-up, always in steps (the report counts steps)
  # Decay window in `schedule_unit`s; the report holds to 28T tokens and decays to 40T of 45T.
  decay_start: float = 28e12
  decay_end: float = 40e12
  # The unit of decay_start / decay_end: "fraction" (of `total_steps`, so the schedule follows
  # the run's length), "steps" or "tokens" (absolute).
  schedule_unit: str = "tokens"
  tokens_per_step: int = 100_600_000  # the report's batch; set from batch × seq_len by the launcher
  # The run's length in steps, read by schedule_unit="fraction" (configs/common.py links it to
  # train.steps, so a --config.train.steps override moves the schedule with it); 0 = unknown.
  total_steps: int = 0
  final_lr_fraction: float = 0.1    # cosine decays to this fraction of `lr`, then holds
  # --- the chain: "muon" (Muon for matrices, Sinkhorn-balanced momentum for embedding, head and
  #     Engram tables, AdamW for the rest; docs/design.md §T2) or "adamw" (the ablation baseline:
  #     AdamW for every group, each group keeping its weight decay, multipliers and schedule) ---
  chain: str = "muon"
  # --- per-group learning-rate multipliers (table rows may add their own, e.g. Engram ×5) ---
  muon_lr_mult: float = 1.0
  adamw_lr_mult: float = 1.0
  sinkhorn_lr_mult: float = 1.0
  # Rows tagged "vision" (the ViT) train at this fraction of their group's rate once unfrozen: the
  # report unfreezes the ViT "at a smaller learning rate"; 0.1 is this project's choice.
  vision_lr_mult: float = 0.1
  # --- gradient clipping by global norm; 0 turns it off ---
  clip_norm: float = 1.0
  # --- Muon ---
  muon_momentum: float = 0.95
  update_rms: float = 0.18          # Muon and Sinkhorn updates are rescaled to this RMS (× lr)
  # Policy of the op `newton_schulz` (docs/design.md §T5): "reference" = float32 products at
  # HIGHEST precision, "kernel" = the bfloat16 iterate with float32 accumulation (within 1 ± 5e-3
  # of orthogonal, benchmarks/RESULTS.md "Muon precision"), "auto" = bfloat16 off the CPU.
  newton_schulz: str = "auto"
  # Newton–Schulz schedule (optim/muon.py NS_SCHEDULES): "spec" = 8 + 2 steps (docs/design.md
  # §T2), "polar_express" = the 8 per-step quintics of Polar Express (benchmarks/RESULTS.md).
  ns_schedule: str = "spec"
  # How Newton–Schulz is split over a mesh (optim/muon.py): "items" = each device iterates its
  # share of every parameter's whole matrices (the parameters' layouts known); "xla" = the batches
  # as on one device, partitioned by XLA (every device then iterates nearly every matrix). One
  # device is the same either way.
  ns_split: str = "items"
  weight_decay: float = 0.1         # decoupled, for the muon and adamw groups
  # --- AdamW ---
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  adam_eps: float = 1e-20
  # --- Sinkhorn-balanced momentum ---
  sinkhorn_momentum: float = 0.95
  sinkhorn_iters: int = 11
  sinkhorn_tau: float = 1e-3        # relative floor on row / column RMS (docs/design.md §T2)
  sinkhorn_eps: float = 1e-20
  # The dtype of X₀² that each row and column step reads (optim/sinkhorn.py): "float32" squares
  # the float32 direction where read; "bfloat16" stores the squares once at half the bytes (the
  # steps read the table ~26 times an update), the direction then within ~2⁻⁸ relative.
  sinkhorn_stat_dtype: str = "float32"
  # The spec names no weight decay for embeddings, head and Engram tables; decaying the rarely
  # hit Engram rows every step would shrink them for no gradient reason.
  sinkhorn_weight_decay: float = 0.0
  # --- MoE routing bias (moe_bias.py), outside the optimizer ---
  moe_bias_gamma: float = 0.001
  # --- trainable mask: parameters matching these path patterns get zero updates until ... ---
  frozen: tuple[str, ...] = ()
  unfreeze_at: str = "never"        # "never" or "decay_start" (e.g. freeze the ViT until decay)

  def __post_init__(self):
    object.__setattr__(self, "frozen", tuple(str(p) for p in self.frozen))
    errors: list[str] = []

    def need(cond, msg):
      if not cond:
        errors.append(msg)

    need(self.chain in ("muon", "adamw"),
         f"chain must be 'muon' or 'adamw' (got {self.chain!r})")
    need(self.lr > 0, f"lr must be positive (got {self.lr})")
    need(self.warmup_steps >= 0, f"warmup_steps must be >= 0 (got {self.warmup_steps})")
    need(self.schedule_unit in ("fraction", "tokens", "steps"),
         f"schedule_unit must be 'fraction', 'tokens' or 'steps' (got {self.schedule_unit!r})")
    need(self.total_steps >= 0, f"total_steps must be >= 0 (got {self.total_steps})")
    if self.schedule_unit == "fraction":
      need(self.decay_end <= 1, f"with schedule_unit='fraction', decay_start ({self.decay_start}) "
           f"and decay_end ({self.decay_end}) are fractions of the run: at most 1")
    need(self.tokens_per_step > 0, f"tokens_per_step must be positive (got {self.tokens_per_step})")
    need(0 <= self.decay_start <= self.decay_end,
         f"need 0 <= decay_start ({self.decay_start}) <= decay_end ({self.decay_end})")
    need(0 <= self.final_lr_fraction <= 1,
         f"final_lr_fraction must lie in [0, 1] (got {self.final_lr_fraction})")
    need(self.clip_norm >= 0, f"clip_norm must be >= 0 (got {self.clip_norm}); 0 turns it off")
    for name in ("muon_momentum", "sinkhorn_momentum", "adam_b1", "adam_b2"):
      need(0 <= getattr(self, name) < 1, f"{name} must lie in [0, 1) (got {getattr(self, name)})")
    need(self.vision_lr_mult >= 0, f"vision_lr_mult must be >= 0 (got {self.vision_lr_mult})")
    need(self.sinkhorn_iters >= 1, f"sinkhorn_iters must be >= 1 (got {self.sinkhorn_iters})")
    need(self.sinkhorn_stat_dtype in STAT_DTYPES,
         f"sinkhorn_stat_dtype must be one of {', '.join(map(repr, STAT_DTYPES))} "
         f"(got {self.sinkhorn_stat_dtype!r})")
    need(self.newton_schulz in dispatch.POLICIES,
         f"newton_schulz: policy {self.newton_schulz!r} is not one of {', '.join(dispatch.POLICIES)}")
    need(self.ns_split in ("items", "xla"),
         f"ns_split must be 'items' or 'xla' (got {self.ns_split!r})")
    need(self.ns_schedule in NS_SCHEDULES,
         f"ns_schedule must be one of {', '.join(map(repr, NS_SCHEDULES))} "
         f"(got {self.ns_schedule!r})")
    need(self.unfreeze_at in ("never", "decay_start"),
         f"unfreeze_at must be 'never' or 'decay_start' (got {self.unfreeze_at!r})")
    if errors:
      raise OptimConfigError("; ".join(errors))


def optim_defaults() -> dict[str, Any]:
  """Every OptimConfig field at its default, as a plain dict (the `cfg.optim` section)."""
  return {f.name: getattr(OptimConfig(), f.name) for f in dataclasses.fields(OptimConfig)}


def optim_config(values: Mapping[str, Any]) -> OptimConfig:
  """Build an OptimConfig from a dict or ConfigDict; unknown keys are an error naming them."""
  values = dict(values)
  known = {f.name for f in dataclasses.fields(OptimConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise OptimConfigError(f"unknown optimizer config keys {unknown}; known keys are {sorted(known)}")
  if "frozen" in values:
    values["frozen"] = tuple(values["frozen"])
  return OptimConfig(**values)
