"""Shared config scaffolding: the ml-collections tree every config file fills in, and the typed,
validated views the launcher reads (`ModelConfig`, `DataConfig`, `OptimConfig`, `TrainConfig`,
`MeshConfig`: one frozen dataclass per section, each check in one place, errors naming the key).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import ml_collections

from data.config import data_defaults
from dsv41_jax.config import ModelConfig, OpPolicies
from dsv41_jax.vision.config import VisionConfig
from optim.config import optim_defaults


def base_config(model: dict) -> ml_collections.ConfigDict:
  """A ConfigDict with a `model` section holding every ModelConfig field (defaults overridden).

  `model["vision"]`, when given, is a dict of VisionConfig fields (the rest at their defaults);
  it also freezes the ViT in the optimizer until the learning-rate decay begins (docs/design.md §T2).
  """
  fields = {f.name: getattr(ModelConfig(), f.name) for f in dataclasses.fields(ModelConfig)}
  _refuse_legacy(model)
  unknown = set(model) - set(fields)
  if unknown:
    raise KeyError(f"unknown model fields {sorted(unknown)}")
  model = dict(model)
  if model.get("vision") is not None:
    model["vision"] = _vision_fields(model["vision"])
  model["ops"] = _ops_fields(model.get("ops", {}))
  fields.update(model)
  cfg = ml_collections.ConfigDict()
  cfg.model = ml_collections.ConfigDict(fields)
  cfg.data = ml_collections.ConfigDict(data_defaults())
  cfg.optim = ml_collections.ConfigDict(optim_defaults())
  # The schedule follows the run: decay boundaries as fractions of train.steps (the report holds
  # to 28T tokens and decays to 40T of 45T), total_steps linked to train.steps so a command-line
  # `--config.train.steps=N` moves the whole schedule with it.
  cfg.optim.schedule_unit = "fraction"
  cfg.optim.decay_start = 28 / 45
  cfg.optim.decay_end = 40 / 45
  if model.get("vision") is not None:
    # The ViT stays frozen until the decay, then trains at optim.vision_lr_mult × lr.
    cfg.optim.frozen = ("vision/**",)
    cfg.optim.unfreeze_at = "decay_start"
  cfg.train = ml_collections.ConfigDict(train_defaults())
  cfg.optim.total_steps = cfg.train.get_ref("steps")
  # Mesh axis sizes (docs/design.md §T1); -1 takes the remaining devices.
  cfg.mesh = ml_collections.ConfigDict(dataclasses.asdict(MeshConfig()))
  return cfg


class SectionError(ValueError):
  """A config section with an unknown key or a bad value; the message names `config.<key>`."""


def _checked(errors: list[str], section: str) -> None:
  if errors:
    raise SectionError("; ".join(f"config.{section}.{e}" for e in errors))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The `train` section: loop length, logging, evaluation and checkpoint cadence."""

  steps: int = 1000
  # Micro-batches per optimizer step (MaxText's gradient_accumulation_steps): the global batch
  # (data.batch_size rows, what the pipeline yields and the optimizer sees) is split into this
  # many micro-batches, run one after another in the step with their gradients summed, so the
  # activations are one micro-batch's (launch.step.make_train_step).
  grad_accum_steps: int = 1
  seed: int = 0
  log_every: int = 10
  eval_every: int = 200          # 0 = no held-out evaluation
  eval_batches: int = 8          # held-out batches per evaluation (0 = the whole held-out split)
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  max_bad_steps: int = 5         # consecutive non-finite steps before the run stops
  # Peak FLOP/s per device for MFU; 0 = from the device kind (989e12 for H100/H200 bf16 dense),
  # and no MFU on devices without a known peak.
  peak_flops_per_device: float = 0.0
  # A tqdm bar when stderr is a terminal; plain log lines otherwise (files, CI, schedulers).
  progress_bar: bool = True
  # On a GPU or TPU, the analytic memory plan before compiling and the compiled train step's peak
  # per device (XLA's memory analysis) before the first step must fit the device, else the run
  # stops with the grad_accum_steps that would fit (launch/setup.py plan_shortfall,
  # memory_shortfall). False: run it anyway.
  memory_check: bool = True
  # jax's persistent compilation cache (launch/compile_cache.py); "" = no cache.
  compilation_cache_dir: str = "~/.cache/dsv41_jax/xla"
  # Leave the scan stacks and conditional residual slots that jax zero-fills before writing them
  # (or never reads) unfilled on GPUs and TPUs (launch/unfilled_buffers.py: XLA AllocateBuffer
  # instead of a zero fill; s3: 9.1 GB of fills a micro-batch, benchmarks/zero_fills.py). The same
  # values; a process-wide patch of two private jax functions, installed when the train step is
  # built (and taken out when a config without it builds one).
  unfilled_buffers: bool = False
  # Weights & Biases project for an extra metrics writer ("" = none; needs `pip install wandb`).
  # TensorBoard and metrics.jsonl are always written.
  wandb_project: str = ""

  def __post_init__(self):
    errors = []
    for name in ("steps", "grad_accum_steps", "log_every", "checkpoint_every", "keep_checkpoints",
                 "max_bad_steps"):
      if getattr(self, name) < 1:
        errors.append(f"{name}={getattr(self, name)} must be >= 1")
    for name in ("eval_every", "eval_batches", "seed"):
      if getattr(self, name) < 0:
        errors.append(f"{name}={getattr(self, name)} must be >= 0")
    if self.peak_flops_per_device < 0:
      errors.append(f"peak_flops_per_device={self.peak_flops_per_device} must be >= 0 "
                    "(0 = from the device kind)")
    _checked(errors, "train")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The `mesh` section: device-mesh axis sizes (docs/design.md §T1); -1 takes the remaining devices.

  Whether the sizes fit the devices is checked where the devices are known (`sharding.make_mesh`).
  """

  data: int = -1
  fsdp: int = 1
  expert: int = 1
  engram: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    errors = [f"{k}={v} must be >= 1 or -1 (the remaining devices)"
              for k, v in sizes.items() if v == 0 or v < -1]
    if sum(v == -1 for v in sizes.values()) > 1:
      errors.append(f"{{{', '.join(k for k, v in sizes.items() if v == -1)}}} are all -1: at most "
                    "one axis can take the remaining devices")
    _checked(errors, "mesh")


def section(cls, values: Mapping[str, Any], name: str):
  """`cls(**values)` for a config section, unknown keys named as `config.<name>.<key>`."""
  known = {f.name for f in dataclasses.fields(cls)}
  values = dict(values)
  unknown = sorted(set(values) - known)
  if unknown:
    raise SectionError(f"config.{name} has unknown keys {unknown}; known keys are {sorted(known)}")
  return cls(**values)


def train_defaults() -> dict:
  """The `train` section's fields at their defaults (`TrainConfig`)."""
  return dataclasses.asdict(TrainConfig())


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """Build (and validate) the frozen ModelConfig from the config's `model` section."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  values = dict(cfg.model)
  _refuse_legacy(values)
  unknown = set(values) - fields
  if unknown:
    raise KeyError(f"config.model has unknown keys {sorted(unknown)}")
  for k, v in values.items():
    if isinstance(v, list):
      values[k] = tuple(v)
  if values.get("vision") is not None:
    values["vision"] = VisionConfig(**_vision_fields(values["vision"]))
  if "ops" in values:
    values["ops"] = OpPolicies.of(_ops_fields(values["ops"]))
  return ModelConfig(**values)


def _refuse_legacy(model) -> None:
  """The model keys that per-op policies replaced (docs/design.md §T5), named with their successor."""
  if "kernels" in model:
    raise SectionError(
        "config.model.kernels is gone: each hot-path op has its own policy, "
        "config.model.ops.<op> = 'auto' | 'reference' | 'kernel' (ops: "
        f"{', '.join(f.name for f in dataclasses.fields(OpPolicies))})")


def _ops_fields(ops) -> dict:
  """Every OpPolicies field, defaults overridden by `ops` (a dict or ConfigDict)."""
  fields = dataclasses.asdict(OpPolicies())
  given = dict(ops)
  unknown = set(given) - set(fields)
  if unknown:
    raise KeyError(f"config.model.ops has unknown ops {sorted(unknown)}; known: {sorted(fields)}")
  fields.update(given)
  return fields


def _vision_fields(vision) -> dict:
  """Every VisionConfig field, defaults overridden by `vision` (a dict or ConfigDict)."""
  fields = {f.name: getattr(VisionConfig(), f.name) for f in dataclasses.fields(VisionConfig)}
  given = dict(vision)
  unknown = set(given) - set(fields)
  if unknown:
    raise KeyError(f"config.model.vision has unknown keys {sorted(unknown)}")
  fields.update(given)
  return fields
