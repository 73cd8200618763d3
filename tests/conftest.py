"""Every test process sees 8 CPU devices, so sharded and unsharded runs can be compared.

The count is fixed when jax starts its CPU client, so it is set here, before any test imports
jax (the recipe of docs/testing.md; `-p dsv41_jax.testing` does the same). A device count already
in XLA_FLAGS wins; other XLA flags are kept.
"""

import os
import sys

_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_COUNT_FLAG}=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
