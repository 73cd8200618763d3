"""Command-line flag parsing shared by every `launch.*` tool: a flag mistake (a missing required
flag, an unknown flag, a bad value, a `--config.` override that does not fit the config file) is
one `error: ...` line on stderr and exit status 2, never absl's `FATAL Flags parsing error` or a
traceback.

  app.run(main, flags_parser=cli.parse_flags)
"""

from __future__ import annotations

import logging
import re
import sys

from absl import flags
from absl import logging as absl_logging


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`flags.FLAGS(argv)`), errors as one `error:` line and exit 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    missing = re.findall(r"flag --(\w+)=None: Flag --\w+ must have a value other than None\.",
                         str(e))
    names = [f"--{m}" for m in missing]
    text = (f"{names[0]} is required" if len(names) == 1 else
            f"{', '.join(names[:-1])} and {names[-1]} are required") if names \
        else " ".join(str(e).split())
    print(f"error: {text}", file=sys.stderr)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # ml_collections raises these for an unknown key ('stepz' ... Did you mean "steps"?).
    text = " ".join(str(e).replace("\\n", " ").replace("\\'", "'").strip("'\" ").split())
    text = re.sub(r"^([^'\s]+)' ", r"'\1' ", text)  # "'stepz' Did you mean ..."
    given = " ".join(a for a in argv[1:] if a.startswith("--config."))
    print(f"error: a --config override does not fit the config file: {text} (overrides given: "
          f"{given}); fix the key or value", file=sys.stderr)
  sys.exit(2)


def log_to_stderr() -> None:
  """absl owns the root logger (set to WARNING: orbax logs every save at INFO); the project's own
  logger ("dsv41.*") gets a stderr handler of its own at INFO."""
  absl_logging.set_verbosity(absl_logging.WARNING)
  ours = logging.getLogger("dsv41")
  if not ours.handlers:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    ours.addHandler(handler)
  ours.setLevel(logging.INFO)
  ours.propagate = False
