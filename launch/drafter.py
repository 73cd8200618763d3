"""A DSpark drafter's work directory (docs/design.md §16.2): its errors, the drafter config at a
backbone's width and vocabulary, and `load_drafter` for `launch.generate --speculative`.

`launch.train_drafter` writes the directory: `config.json` (sections `drafter`, `backbone`, `train`)
and `checkpoints/<step>/state` holding the drafter's parameters, optimizer state and step.
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from dsv41_jax.dspark.config import DrafterConfig, DrafterConfigError
from dsv41_jax.dspark.model import Drafter


class DrafterStageError(ValueError):
  """The drafter stage cannot run as configured; the message names the setting."""


class DrafterMissing(DrafterStageError):
  """The drafter directory holds no trained drafter."""


def drafter_config(section, backbone_model) -> DrafterConfig:
  """The config's `drafter` section as a DrafterConfig at the backbone's width and vocabulary."""
  fields = dict(section)
  for name in ("hidden_size", "vocab_size"):
    have = int(getattr(backbone_model, name))
    given = int(fields.get(name) or 0)
    if given and given != have:
      raise DrafterStageError(f"config.drafter.{name}={given} does not match the backbone's "
                              f"{name} {have}; set it to {have} or 0 (= the backbone's)")
    fields[name] = have
  try:
    return DrafterConfig(**fields)
  except (DrafterConfigError, TypeError) as e:
    raise DrafterStageError(f"config.{e}" if isinstance(e, DrafterConfigError) else
                            f"config.drafter: {e}") from None


def load_drafter(directory: str, backbone) -> Drafter:
  """The newest drafter checkpoint of `directory` for `backbone` (a `launch.generate.LoadedModel`):
  DrafterMissing when there is none, DrafterStageError when it was trained for another width or
  vocabulary."""
  import orbax.checkpoint as ocp
  path = os.path.join(directory, "config.json")
  ckpts = os.path.join(directory, "checkpoints")
  steps = sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) if os.path.isdir(ckpts) else []
  if not os.path.exists(path) or not steps:
    raise DrafterMissing(f"{directory} holds no drafter checkpoint (expected config.json and "
                         "checkpoints/<step>/ written by launch.train_drafter)")
  with open(path) as f:
    stored = json.load(f)
  dc = DrafterConfig(**stored["drafter"])
  m = backbone.model.cfg
  for name in ("hidden_size", "vocab_size"):
    if getattr(dc, name) != getattr(m, name):
      raise DrafterStageError(f"the drafter in {directory} was trained for {name} "
                              f"{getattr(dc, name)}; this backbone has {name} {getattr(m, name)}")
  dgraph, abstract = nnx.split(nnx.eval_shape(lambda: Drafter(dc, nnx.Rngs(0))))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                   nnx.as_pure(abstract))}
  state_dir = os.path.join(os.path.abspath(ckpts), str(steps[-1]), "state")
  restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=True))
  return nnx.merge(dgraph, restored["params"])
