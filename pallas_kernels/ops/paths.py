"""Op: the one name of a parameter, the '/'-joined keys of its path in the parameter tree.

`runs/0/core/attn/wq_b`, `engram/…`, `head`: the optimizer table routes by these names
(`optim/table.py`, docs/design.md §T2), the sharding rules report them and the ledger attributes
parameters to the layers of the plan by them (`dsv41_jax/param_paths.py`). It sits with the ops
so that the optimizer names parameters without importing the model.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(keypath: Sequence[Any]) -> str:
  """'/'-joined path of a jax key path; a trailing `.value` of an nnx.Variable is dropped."""
  keys = list(keypath)
  if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
    keys = keys[:-1]
  return "/".join(_key_name(k) for k in keys)
