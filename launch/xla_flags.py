"""Default XLA flags for training programs on GPUs (docs/design.md §T1), applied before jax starts.

The train step is one large program: XLA's GPU autotuners (the per-fusion autotuner that compares
emitters, and Triton GEMM configurations for every matrix product) would compile many variants of
each fusion and product, which made the step's compilation take many minutes on the H200
(benchmarks/RESULTS.md, "Train step on one H200"). These defaults turn both off: products go to
cuBLAS. A flag the user already sets in `XLA_FLAGS` is left as they set it; `DSV41_XLA_DEFAULTS=0`
turns the defaults off.
"""

from __future__ import annotations

import os

GPU_DEFAULTS = {
    "xla_gpu_experimental_enable_fusion_autotuner": "false",
    "xla_gpu_enable_triton_gemm": "false",
}


def apply_defaults(environ=os.environ) -> str:
  """Append the defaults not already named in XLA_FLAGS; returns the resulting XLA_FLAGS."""
  flags = environ.get("XLA_FLAGS", "")
  if environ.get("DSV41_XLA_DEFAULTS", "1") != "0":
    extra = [f"--{k}={v}" for k, v in GPU_DEFAULTS.items() if f"--{k}" not in flags]
    flags = " ".join([flags, *extra]).strip()
    environ["XLA_FLAGS"] = flags
  return flags
