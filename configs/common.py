"""Shared config scaffolding: the ml-collections tree every config file fills in."""

from __future__ import annotations

import dataclasses

import ml_collections

from data.config import data_defaults
from dsv41_jax.config import ModelConfig
from dsv41_jax.vision.config import VisionConfig
from optim.config import optim_defaults


def base_config(model: dict) -> ml_collections.ConfigDict:
  """A ConfigDict with a `model` section holding every ModelConfig field (defaults overridden).

  `model["vision"]`, when given, is a dict of VisionConfig fields (the rest at their defaults);
  it also freezes the ViT in the optimizer until the learning-rate decay begins (TRAINING.md §2).
  """
  fields = {f.name: getattr(ModelConfig(), f.name) for f in dataclasses.fields(ModelConfig)}
  unknown = set(model) - set(fields)
  if unknown:
    raise KeyError(f"unknown model fields {sorted(unknown)}")
  model = dict(model)
  if model.get("vision") is not None:
    model["vision"] = _vision_fields(model["vision"])
  fields.update(model)
  cfg = ml_collections.ConfigDict()
  cfg.model = ml_collections.ConfigDict(fields)
  cfg.data = ml_collections.ConfigDict(data_defaults())
  cfg.optim = ml_collections.ConfigDict(optim_defaults())
  if model.get("vision") is not None:
    # The ViT stays frozen until the decay, then trains at optim.vision_lr_mult × lr.
    cfg.optim.frozen = ("vision/**",)
    cfg.optim.unfreeze_at = "decay_start"
  cfg.train = ml_collections.ConfigDict(train_defaults())
  # Mesh axis sizes (TRAINING.md §1); -1 takes the remaining devices.
  cfg.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, engram=1, tensor=1))
  return cfg


def train_defaults() -> dict:
  """The `train` section: loop length, logging, evaluation and checkpoint cadence."""
  return dict(
      steps=1000,
      seed=0,
      log_every=10,
      eval_every=200,
      eval_batches=8,            # held-out batches per evaluation (0 = the whole held-out split)
      checkpoint_every=200,
      keep_checkpoints=3,
      max_bad_steps=5,           # consecutive non-finite steps before the run stops
      # Peak FLOP/s per device for MFU; 0 = from the device kind (989e12 for H100/H200 bf16
      # dense), and no MFU on devices without a known peak.
      peak_flops_per_device=0.0,
      progress_bar=True,
      # jax's persistent compilation cache (launch/compile_cache.py); "" = no cache.
      compilation_cache_dir="~/.cache/dsv41_jax/xla",
  )


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """Build (and validate) the frozen ModelConfig from the config's `model` section."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  values = dict(cfg.model)
  unknown = set(values) - fields
  if unknown:
    raise KeyError(f"config.model has unknown keys {sorted(unknown)}")
  for k, v in values.items():
    if isinstance(v, list):
      values[k] = tuple(v)
  if values.get("vision") is not None:
    values["vision"] = VisionConfig(**_vision_fields(values["vision"]))
  return ModelConfig(**values)


def _vision_fields(vision) -> dict:
  """Every VisionConfig field, defaults overridden by `vision` (a dict or ConfigDict)."""
  fields = {f.name: getattr(VisionConfig(), f.name) for f in dataclasses.fields(VisionConfig)}
  given = dict(vision)
  unknown = set(given) - set(fields)
  if unknown:
    raise KeyError(f"config.model.vision has unknown keys {sorted(unknown)}")
  fields.update(given)
  return fields
