"""The ledger of the full V4.1-Flash config, from the real parameter and cache shapes (docs/design.md §1, §10)."""

import json
import subprocess
import sys

import pytest

from dsv41_jax import cache_layout, ledger as ledger_lib
from dsv41_jax.config import ModelConfig


@pytest.fixture(scope="module")
def flash():
  return ledger_lib.ledger(ModelConfig())


def test_flash_parameter_counts(flash):
  assert abs(flash["backbone_params"] / 1e9 - 551.9) < 0.1         # report: 552B
  assert abs(flash["engram_params"] / 1e9 - 196.6) < 0.05          # report: 196B
  assert flash["total_params"] == (flash["backbone_params"] + flash["engram_params"]
                                   + flash["vision_params"])
  assert 15.5e9 < flash["active_params_decode"] < 16.5e9           # report: 16B
  assert 7.5e9 < flash["active_params_prefill"] < 8.5e9            # report: 8B


def test_flash_kv_bytes(flash):
  assert flash["global_kv_bytes_per_token"] == 890                 # exactly the report's figure
  layout = cache_layout.global_kv_layout(ModelConfig())
  assert (layout.main_kv_bytes, layout.index_k_bytes) == (288, 68)
  assert float(layout.entries_per_token) == 2.5
  assert flash["swa_kv_bytes_per_sequence"] == 128 * 528 * 40


def test_kv_bytes_follow_the_plan():
  # One fewer encoder KV source: 2 × ½ + 1 entries per token.
  cfg = ModelConfig(kv_source_layer_ids=(2, 8, 20), index_source_layer_ids=(2, 8, 20, 24, 28, 32, 36))
  assert cache_layout.global_kv_layout(cfg).bytes_per_token == 2 * 356


def test_ledger_cli_json():
  out = subprocess.run([sys.executable, "-m", "launch.ledger", "--config=configs/tiny.py", "--json"],
                       capture_output=True, text=True, check=True, timeout=300)
  d = json.loads(out.stdout.strip().splitlines()[-1])
  for k in ("total_params", "backbone_params", "engram_params", "active_params_prefill",
            "active_params_decode", "global_kv_bytes_per_token", "swa_kv_bytes_per_sequence",
            "train_flops_per_token"):
    assert k in d and d[k] > 0, k
