"""Print the model's ledger from abstract shapes (no allocation).

  python -m launch.ledger --config=configs/flash.py [--json]
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from configs.common import model_config
from dsv41_jax.ledger import ledger
from launch import cli


def _define_flags():
  """Command-line flags, defined only when run as a program."""
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
  flags.DEFINE_bool("json", False, "Print one JSON object.")


def _fmt(key: str, value) -> str:
  if "params" in key:
    return f"{value:>20,d}  ({value / 1e9:.2f} B)" if value >= 1e9 else f"{value:>20,d}  ({value / 1e6:.2f} M)"
  if key == "train_flops_per_token":
    return f"{value:>20.4e}"
  return f"{value:>20,}"


def main(argv):
  del argv
  cfg = model_config(flags.FLAGS.config)
  result = ledger(cfg)
  if flags.FLAGS.json:
    print(json.dumps(result))
    return
  for k, v in result.items():
    print(f"{k:28s}{_fmt(k, v)}")


if __name__ == "__main__":
  _define_flags()
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=cli.parse_flags)
