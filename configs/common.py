"""Shared config scaffolding: the ml-collections tree every config file fills in."""

from __future__ import annotations

import dataclasses

import ml_collections

from data.config import data_defaults
from dsv41_jax.config import ModelConfig
from optim.config import optim_defaults


def base_config(model: dict) -> ml_collections.ConfigDict:
  """A ConfigDict with a `model` section holding every ModelConfig field (defaults overridden)."""
  fields = {f.name: getattr(ModelConfig(), f.name) for f in dataclasses.fields(ModelConfig)}
  unknown = set(model) - set(fields)
  if unknown:
    raise KeyError(f"unknown model fields {sorted(unknown)}")
  fields.update(model)
  cfg = ml_collections.ConfigDict()
  cfg.model = ml_collections.ConfigDict(fields)
  cfg.data = ml_collections.ConfigDict(data_defaults())
  cfg.optim = ml_collections.ConfigDict(optim_defaults())
  return cfg


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
  return ModelConfig(**values)
