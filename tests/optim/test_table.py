"""The optimizer table (optim/table.py): pattern semantics, labelling errors, report."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from optim import table
from optim.table import Row, TableError


def _sds(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.mark.parametrize("pattern,path,hit", [
    ("**/attn/wq_b", "runs/0/core/attn/wq_b", True),
    ("**/attn/wq_b", "attn/wq_b", True),                      # ** matches no component too
    ("**/attn/wq_b", "runs/0/reindex/indexer/wq_b", False),
    ("**/attn/wq_b", "runs/0/core/attn/wq_b2", False),
    ("**/*norm/scale", "final_norm/scale", True),
    ("**/*norm/scale", "runs/1/full/compressor/norm/scale", True),
    ("**/*norm/scale", "runs/1/core/attn_hc/scale", False),
    ("**/{attn_hc,ffn_hc}/fn", "runs/1/core/ffn_hc/fn", True),
    ("**/{attn_hc,ffn_hc}/fn", "runs/1/core/xattn_hc/fn", False),
    ("embed", "segments/0/embed", False),                      # patterns match the whole path
    ("layers/*/w", "layers/0/1/w", False),                     # * stays within one component
])
def test_pattern_semantics(pattern, path, hit):
  assert Row(pattern, "adamw").matches(path) is hit


def test_unclaimed_and_doubly_claimed_are_named():
  params = {"a": {"w": _sds(4, 4), "b": _sds(4)}, "c": _sds(4, 4), "d": _sds(3)}
  rows = (Row("a/*", "muon"), Row("**/b", "adamw"), Row("c", "sinkhorn"))
  with pytest.raises(TableError) as e:
    table.label_params(params, rows)
  msg = str(e.value)
  assert "claimed by no table row: ['d']" in msg
  assert "a/b (rows ['a/*', '**/b'])" in msg
  assert "a/w" not in msg and "'c'" not in msg


def test_rank_the_row_cannot_handle_is_named():
  with pytest.raises(TableError, match=r"q \(shape \(4, 4\), row 'q' needs rank >= 3\)"):
    table.label_params({"q": _sds(4, 4)}, (Row("q", "muon", headwise=True),))


def test_row_matching_nothing_is_named():
  rows = table.TABLE + (Row("**/moe/gate_bias", "adamw"),)
  tree = {"embed": _sds(8, 4), "runs": {"0": {"core": {"moe": {"router": _sds(4, 8)}}}}}
  with pytest.raises(TableError) as e:
    table.check_rows_used([tree], rows)
  assert "'**/moe/gate_bias'" in str(e.value) and "'embed'" not in str(e.value)
  assert "'**/moe/router'" not in str(e.value)


def test_bad_rows_rejected():
  with pytest.raises(TableError, match="unknown group"):
    Row("x", "sgd")
  with pytest.raises(TableError, match="headwise"):
    Row("x", "adamw", headwise=True)
  with pytest.raises(TableError, match="unclosed"):
    Row("{a,b", "adamw")


def test_variables_pure_state_and_dict_label_alike():
  class Blk(nnx.Module):
    def __init__(self):
      self.wq_b = nnx.Param(jnp.ones((8, 2, 4)))
      self.attn_sink = nnx.Param(jnp.ones((2,)))

  class M(nnx.Module):
    def __init__(self):
      self.embed = nnx.Param(jnp.ones((16, 8)))
      self.attn = Blk()

  state = nnx.state(M(), nnx.Param)
  rows = (Row("embed", "sinkhorn"), Row("**/attn/wq_b", "muon", headwise=True),
          Row("**/attn/attn_sink", "adamw"))
  want = {"embed": "sinkhorn", "attn/wq_b": "muon", "attn/attn_sink": "adamw"}
  for tree in (state, nnx.as_pure(state) if hasattr(nnx, "as_pure") else nnx.pure(state),
               nnx.to_pure_dict(state)):
    got = {p: r.group for p, r in table.label_params(tree, rows).items()}
    assert got == want


def test_report_lists_every_parameter_and_state_bytes():
  params = {"embed": _sds(10, 4), "final_norm": {"scale": _sds(4)},
            "runs": {"0": {"core": {"attn": {"wq_b": _sds(3, 8, 2, 4)}}}}}
  text = table.report(params)
  lines = text.splitlines()
  assert any(l.startswith("embed ") and l.rstrip().endswith("160") and "sinkhorn" in l
             for l in lines)
  assert any(l.startswith("final_norm/scale ") and l.rstrip().endswith(" 32") for l in lines)
  assert any("runs/0/core/attn/wq_b" in l and "muon headwise" in l
             and l.rstrip().endswith("768") for l in lines)
  assert any(l.startswith("adamw") and "4 parameters" in l and "32 state bytes" in l for l in lines)
