"""dsv41_jax/param_paths.py: one name per parameter whichever way the tree is walked, and every
element attributed to exactly the layers of the plan that own it."""

import collections

import jax
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import model as model_lib, testing
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.param_paths import iter_params, path_str, per_layer_params


def test_path_str_names_a_parameter_the_same_through_its_variable_or_its_value():
  state = model_lib.abstract_params(testing.tiny_config())
  through_value = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  at_variable = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]]
  assert through_value == at_variable
  assert "head" in through_value and "final_norm/scale" in through_value
  assert not [p for p in through_value if "value" in p or "[" in p or "." in p]
  assert path_str(("runs", 0, "core")) == "runs/0/core"   # plain keys (nnx.iter_modules)


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_per_layer_params_attribute_every_element_once_to_the_plans_layers(which):
  # Flash's Engram layers (1 and 14) are not the first layers of their runs (0 and 2).
  cfg = testing.tiny_config() if which == "tiny" else ModelConfig()
  state = model_lib.abstract_params(cfg)
  plan = build_layer_plan(cfg)
  rows = list(per_layer_params(cfg, state))
  assert sum(size for _, _, size in rows) == model_lib.param_count(state)
  assert sum(int(np.prod(shape)) for _, shape in iter_params(state)) == model_lib.param_count(state)
  by_layer = collections.defaultdict(set)
  for layer, rest, _ in rows:
    by_layer[layer].add(rest)
  assert set(by_layer) == set(range(cfg.num_hidden_layers)) | {None}
  for spec in plan:
    names = by_layer[spec.index]
    assert "attn/wq_a" in names, spec.index
    assert any(n.startswith("compressor/") for n in names) == spec.owns_compressor, spec.index
    assert any(n.startswith("indexer/") for n in names) == spec.owns_indexer, spec.index
    assert any(n.startswith("engram/table") for n in names) == spec.engram, spec.index
