"""Every test process sees 8 CPU devices, so sharded and unsharded runs can be compared, and
compiles with LLVM's cheap passes.

The count is fixed when jax starts its CPU client, so it is set here, before any test imports
jax (the recipe of docs/testing.md; `-p dsv41_jax.testing` does the same). A device count already
in XLA_FLAGS wins; other XLA flags are kept.

Compilation dominates the suite on CPU, so the tests compile as `configs/ladder.py`'s FAST_CPU
and `tests/launch/test_train.py`'s subprocesses do: LLVM's optimisation level 0 without its
expensive passes. That changes compile speed and float rounding, not semantics (the tests that
read the compiled HLO pass unchanged); the programs a test compares compile under the same flags,
except where equal bits need LLVM's full pipeline (`test_csa2_attention.py`). A
flag already in XLA_FLAGS wins: `XLA_FLAGS=--xla_backend_optimization_level=3` runs the suite
with the full pipeline. XLA's depth-first CPU schedule is set too, as `launch.train` sets it: it
orders the program's operations, not their arithmetic, and keeps collectives in conditionals on a
CPU mesh from stopping the program (user guide §8). (XLA's elemental emitters, FASTER_CPU's third
flag, would change the HLO that tests inspect: a scatter expanded into a loop.)
"""

import os
import sys

_COUNT_FLAG = "--xla_force_host_platform_device_count"
_FAST_FLAGS = {"--xla_backend_optimization_level": "0",
               "--xla_llvm_disable_expensive_passes": "true",
               # the depth-first CPU schedule, as launch.train's defaults (user guide §8)
               "--xla_cpu_enable_concurrency_optimized_scheduler": "false"}

_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in {_COUNT_FLAG: "8", **_FAST_FLAGS}.items():
  if _name not in _flags:
    _flags = f"{_flags} {_name}={_value}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
