"""benchmarks/common.py: the step benchmarks' `--set` config overrides."""

import ml_collections
import pytest

from benchmarks.common import set_overrides
from configs import small


def test_set_overrides_parse_by_the_replaced_type_and_name_bad_items():
  cfg = small.get_config("s1")
  set_overrides(cfg, ["model.ops.hc_site=reference", "model.remat=false", "train.steps=7",
                      "optim.lr=0.5"])
  assert (cfg.model.ops.hc_site, cfg.model.remat, cfg.train.steps, cfg.optim.lr) == (
      "reference", False, 7, 0.5)
  for item, msg in (("model.ops.no_such_op=kernel", "no config key 'model.ops.no_such_op'"),
                    ("model.remat=maybe", "'maybe' does not parse as bool"),
                    ("train.steps=1.5", "'1.5' does not parse as int"),
                    ("model.remat", "expected key=value")):
    with pytest.raises(SystemExit, match=msg):
      set_overrides(cfg, [item])
  set_overrides(cfg, ["model.remat_saves=projections,experts"])
  assert cfg.model.remat_saves == ("projections", "experts")
  d = ml_collections.ConfigDict({"a": None})
  set_overrides(d, ["a=x"])
  assert d.a == "x"

