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
