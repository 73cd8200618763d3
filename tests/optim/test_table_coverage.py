"""Every parameter of every model config is claimed by exactly one table row, and every row claims
something in some config (docs/design.md §T2)."""

import pytest

from configs import common, flash, tiny
from optim import table
from tests.optim.synthetic_params import synthetic_params

CONFIGS = {"tiny": tiny, "flash": flash}


def _model_cfg(name):
  return common.model_config(CONFIGS[name].get_config())


@pytest.fixture(scope="module")
def model_trees():
  model = pytest.importorskip("dsv41_jax.model")
  return {name: model.abstract_params(_model_cfg(name)) for name in CONFIGS}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_params_each_claimed_once(model_trees, name):
  rows = table.label_params(model_trees[name])
  assert len(rows) > 0
  # spot checks of the routing the spec asks for
  for path, row in rows.items():
    if path.endswith(("attn/wq_b", "indexer/wq_b")):
      assert row.group == "muon" and row.headwise, path
    if path.endswith("engram/table"):
      assert row.group == "sinkhorn" and row.lr_mult == 5.0, path
    if path in ("embed", "head"):
      assert row.group == "sinkhorn", path


def test_every_row_matches_some_model_config(model_trees):
  table.check_rows_used(model_trees.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_synthetic_naming_tree_claimed_once(name):
  table.label_params(synthetic_params(_model_cfg(name)))


def test_every_row_matches_the_synthetic_trees():
  table.check_rows_used([synthetic_params(_model_cfg(n)) for n in CONFIGS])
