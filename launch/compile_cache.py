"""jax's persistent compilation cache, on by default, so a resume or a second run of the same
config loads its programs instead of compiling them again (docs/design.md §T1).

The directory is `train.compilation_cache_dir` (default `~/.cache/dsv41_jax/xla`; "" turns the
cache off). A directory that cannot be created or written only warns: the run compiles as if there
were no cache. jax itself warns and carries on when an entry cannot be written (a full disk).
"""

from __future__ import annotations

import logging
import os
import tempfile

import jax

log = logging.getLogger("dsv41.compile_cache")

DEFAULT_DIR = "~/.cache/dsv41_jax/xla"


def enable(directory: str | None) -> str | None:
  """Point jax's persistent cache at `directory`; the directory in use, or None (no cache)."""
  if not directory:
    return None
  path = os.path.abspath(os.path.expanduser(directory))
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
      pass
  except OSError as e:
    log.warning("compilation cache %s is not usable (%s); compiling without a cache", path, e)
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  # Cache every program that took noticeable time, whatever its size.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
