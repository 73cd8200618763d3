"""launch/cli.py: every tool answers a flag mistake with one `error:` line and exit status 2
(issue 33: `launch.generate` without `--prompt` was absl's `FATAL Flags parsing error`, exit 1)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("module, args, message", [
    ("launch.generate", ["--workdir=/tmp/none"], "error: --prompt is required"),
    ("launch.score", ["--workdir=/tmp/none", "--dta=x.jsonl"], "error: Unknown command line flag "
     "'dta'"),
    ("launch.ledger", ["--config=configs/tiny.py", "--config.model.hidden_sise=3"],
     "error: a --config override does not fit the config file"),
    ("launch.ladder", ["--lst"], "error: Unknown command line flag 'lst'"),
    ("launch.train_drafter", [], "error: --config, --backbone and --workdir are required"),
    ("launch.convert", ["import", "--nope"], "error: Unknown command line flag 'nope'"),
])
def test_flag_mistakes_are_one_error_line(module, args, message):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  lines = p.stderr.strip().splitlines()
  assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), p.stderr[-2000:]


def test_every_launch_module_imports_beside_the_others():
  """A test worker imports many launch modules into one process: a module that defines its
  absl flags at import time (`--config` in both launch.train and launch.train_drafter) fails the
  second import with DuplicateFlagError, so only one program may define flags at load time."""
  names = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "launch"))
                 if f.endswith(".py") and f != "__init__.py")
  code = "import importlib\n" + "".join(f"importlib.import_module('launch.{n}')\n" for n in names)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
