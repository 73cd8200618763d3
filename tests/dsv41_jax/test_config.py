"""dsv41_jax/config.py: the shipped configs build and cover every mode; inconsistent configs are
errors naming their fields."""

import pytest

from configs import common, flash, tiny
from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.layer_plan import build_layer_plan


def test_tiny_config_exercises_every_mode():
  cfg = common.model_config(tiny.get_config())
  modes = {l.mode for l in build_layer_plan(cfg)}
  assert modes == {"swa", "full", "reindex", "reuse"}
  # The released configuration: every text field at its default, plus the default vision tower;
  # pre-training runs without YaRN (docs/design.md §4.5), the long-context phase with it.
  from dsv41_jax.vision.config import VisionConfig
  assert common.model_config(flash.get_config("long")) == ModelConfig(vision=VisionConfig())
  assert common.model_config(flash.get_config()) == ModelConfig(vision=VisionConfig(),
                                                                yarn_enabled=False)


@pytest.mark.parametrize("changes, names", [
    (dict(num_attention_heads=60), ["num_attention_heads", "o_groups"]),
    (dict(kv_source_layer_ids=(3, 8, 14, 20)), ["kv_source_layer_ids", "index_source_layer_ids"]),
    (dict(kv_source_layer_ids=(1, 8, 14, 20)), ["kv_source_layer_ids", "layer 1"]),
    (dict(seq_len=512), ["index_topk", "seq_len"]),
    (dict(seq_len=64, index_topk=16), ["sliding_window", "seq_len"]),
    (dict(engram_layer_ids=(1, 40)), ["engram_layer_ids"]),
    (dict(engram_vocab_size=0), ["engram_vocab_size"]),
])
def test_inconsistent_configs_name_their_fields(changes, names):
  with pytest.raises(ConfigError) as err:
    ModelConfig(**changes)
  for n in names:
    assert n in str(err.value)
