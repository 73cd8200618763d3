"""Default XLA flags for training programs on GPUs (docs/design.md §T1), applied before jax starts.

The train step is one large program: XLA's GPU autotuners (the per-fusion autotuner that compares
emitters, and Triton GEMM configurations for every matrix product) would compile many variants of
each fusion and product, which made the step's compilation take many minutes on the H200
(benchmarks/RESULTS.md, "Train step on one H200"). These defaults turn both off: products go to
cuBLAS. A flag the user already sets in `XLA_FLAGS` is left as they set it; `DSV41_XLA_DEFAULTS=0`
turns the defaults off.

On the CPU the default is XLA's depth-first HLO schedule instead of its concurrency-optimized
breadth-first one (`xla_cpu_enable_concurrency_optimized_scheduler=false`). With the breadth-first
schedule, a step on a mesh of CPU devices (`--xla_force_host_platform_device_count`) could stop
with "Termination timeout for collective permute": XLA's CPU runtime ran a collective inside a
scanned layer's conditional (the CSA2 kind `lax.switch`; then also the Engram `lax.cond`) and an
independent one outside it in different orders on different devices. The tiny config on
data 2 × fsdp 2 × tensor 2 stopped so in 3 of 3 runs with it and 0 of 6 with the depth-first
schedule (float32 and bfloat16; benchmarks/RESULTS.md, 2026-12-05). The flag changes the order of
the CPU program's operations, not their arithmetic; GPUs and TPUs do not read it.
"""

from __future__ import annotations

import os

GPU_DEFAULTS = {
    "xla_gpu_experimental_enable_fusion_autotuner": "false",
    "xla_gpu_enable_triton_gemm": "false",
}
CPU_SCHEDULE = "xla_cpu_enable_concurrency_optimized_scheduler"
CPU_DEFAULTS = {CPU_SCHEDULE: "false"}


def apply_defaults(environ=os.environ) -> str:
  """Append the defaults not already named in XLA_FLAGS; returns the resulting XLA_FLAGS."""
  flags = environ.get("XLA_FLAGS", "")
  if environ.get("DSV41_XLA_DEFAULTS", "1") != "0":
    extra = [f"--{k}={v}" for k, v in {**GPU_DEFAULTS, **CPU_DEFAULTS}.items()
             if f"--{k}" not in flags]
    flags = " ".join([flags, *extra]).strip()
    environ["XLA_FLAGS"] = flags
  return flags


def cpu_schedule_is_depth_first(environ=os.environ) -> bool:
  """Whether XLA_FLAGS selects the CPU's depth-first schedule (the last setting of the flag wins,
  as in XLA's own parsing)."""
  name = f"--{CPU_SCHEDULE}"
  values = [f.split("=", 1)[1] if "=" in f else "true"
            for f in environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] == name]
  return bool(values) and values[-1].lower() in ("false", "0")
