"""Parameter paths: the one name of a parameter, and the layer of the plan it belongs to.

A parameter is named by the '/'-joined keys of its path in the parameter tree
(`runs/0/core/attn/wq_b`, `engram/…`, `head`; `path_str`, the op `pallas_kernels.ops.paths`);
the optimizer table routes by these names, the sharding rules report them, and the ledger and
the FLOP count attribute parameters to the layers of the plan (docs/design.md §2) by them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterator

import jax
import numpy as np

from dsv41_jax.layer_plan import build_layer_plan
from pallas_kernels.ops.paths import path_str

if TYPE_CHECKING:  # annotations only: the config imports the plan, which this module reads
  from dsv41_jax.config import ModelConfig

_LAYER_PATH = re.compile(r"^runs/(\d+)/([^/]+)/(.*)$")


def iter_params(state) -> Iterator[tuple[str, tuple[int, ...]]]:
  """(path, shape) of every leaf of a (possibly abstract) parameter state."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    yield path_str(path), tuple(leaf.shape)


def per_layer_params(cfg: "ModelConfig", state):
  """Yield (layer id or None, path within the layer, per-layer element count) for every param.

  A run's `core/...` stacks hold one row per layer of the run, its `<kind>/...` stacks one row per
  layer of that kind, and its `engram/...` belongs to the run's Engram layer (`layer_plan.Run`).
  """
  plan = build_layer_plan(cfg)
  for path, shape in iter_params(state):
    m = _LAYER_PATH.match(path)
    size = int(np.prod(shape))
    if not m:
      yield None, path, size
      continue
    run = plan.runs[int(m.group(1))]
    group, rest = m.group(2), m.group(3)
    if group == "engram":
      yield run.engram_layer, f"engram/{rest}", size
      continue
    if group == "core":
      layers = [l.index for l in run.layers]
    else:
      k = next(k for k, spec in enumerate(run.kinds) if spec.kind_name == group)
      layers = run.layers_of_kind(k)
    for layer in layers:
      yield layer, rest, size // len(layers)
