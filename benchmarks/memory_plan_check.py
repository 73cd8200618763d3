"""The analytic memory plan against XLA's figures (launch/memory_plan.py; RESULTS.md session 51).

  python benchmarks/memory_plan_check.py             # both parts
  python benchmarks/memory_plan_check.py --part cpu   # SCORE_COPIES against the CPU compile
  python benchmarks/memory_plan_check.py --part h200  # the plan for the GPU against H200 figures

cpu:  compiles the micro model's gradient step (configs/tiny.py:micro, batch 8, remat) on 4 fake
      CPU devices under the test suite's XLA flags (tests/conftest.py: the depth-first schedule)
      at T = 128, 256, 512 (data 2 × fsdp 2) and T = 320 (expert 2 × engram 2, the test's check
      shape) and prints XLA's bytes (arguments + outputs − aliased + temporaries), the plan's, and
      how many score-sized copies XLA's figure leaves beside the plan's other terms.
h200: the plan for the GPU (`--backend=gpu`'s) of s3 and m3 beside XLA's figures measured on one
      H200 by earlier sessions (`H200` below: where each comes from), and the CPU plan's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB, GiB = 2.0 ** 20, 2.0 ** 30
F32 = dict(hc_stream_dtype="float32", moe_product_dtype="float32")
REFERENCE = ("sparse_attention", "hc_site", "hc_coefficients")
# (size, model overrides, ops on "reference", rows, micro-batches, XLA's GiB on the H200, source)
H200 = (
    ("s3", {}, (), 32, 8, 43.7, "RESULTS 2026-12-04 session 47, gpu_step peak"),
    ("m3", {}, (), 32, 8, 80.8, "RESULTS 2026-12-04 session 47, gpu_step peak"),
    ("s3", F32, (), 32, 1, 113.3, "RESULTS session 44, the memory check's figure"),
    ("s3", F32, (), 32, 2, 83.8, "RESULTS 2026-12-02d, program"),
    ("s3", F32, (), 32, 4, 58.7, "RESULTS 2026-12-02d, program"),
    ("s3", F32, (), 32, 8, 46.3, "RESULTS 2026-12-02d, program"),
    ("s3", F32, (), 4, 1, 33.5, "RESULTS 2026-12-01 evening, gpu_step peak"),
    ("s3", F32, REFERENCE, 4, 1, 48.2, "RESULTS 2026-12-01 evening, gpu_step peak"),
)


def cpu_part() -> None:
  flags = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
           "--xla_llvm_disable_expensive_passes=true "
           "--xla_cpu_enable_concurrency_optimized_scheduler=false")
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  from configs import tiny
  from configs.common import model_config
  from dsv41_jax import sharding
  from launch import aot, memory_plan
  print("| mesh | T | XLA MiB | plan MiB | plan / XLA | score copies XLA leaves |")
  print("|---|---:|---:|---:|---:|---:|")
  for mesh, T in (({"data": 2, "fsdp": 2}, 128), ({"data": 2, "fsdp": 2}, 256),
                  ({"data": 2, "fsdp": 2}, 512), ({"expert": 2, "engram": 2}, 320)):
    cfg = tiny.get_config("micro")
    cfg.data.seq_len = cfg.model.seq_len = T
    sizes = memory_plan.resolve_mesh(mesh, 4)
    mesh_ = sharding.make_mesh(sizes, jax.devices()[:4])
    compiled, _ = aot.compile_grad_step(aot.lower_args(cfg, mesh_, 8))
    m = aot.memory_stats(compiled)
    got = m["argument"] + m["output"] - m["alias"] + m["temp"]
    mcfg = model_config(cfg)
    plan = memory_plan.analytic_plan(mcfg, sizes, 8, T, backend="cpu")
    want = plan["param_bytes"] + plan["grad_bytes"] + plan["activation_bytes"]["total"]
    copies = memory_plan.SCORE_COPIES
    try:
      memory_plan.SCORE_COPIES = 0
      bare = memory_plan.activation_bytes(mcfg, plan["rows_per_device"], T, sizes, "cpu")["total"]
      memory_plan.SCORE_COPIES = 1
      one = memory_plan.activation_bytes(mcfg, plan["rows_per_device"], T, sizes, "cpu")["total"]
    finally:
      memory_plan.SCORE_COPIES = copies
    fixed = plan["param_bytes"] + plan["grad_bytes"] + bare
    print(f"| {mesh} | {T} | {got / MiB:.2f} | {want / MiB:.2f} | {want / got:.3f} | "
          f"{(got - fixed) / (one - bare):.2f} |", flush=True)


def h200_part() -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from configs import small
  from configs.common import model_config
  from launch import memory_plan
  print("| size | overrides | micro-batches | H200 GiB | plan for the GPU (ratio) "
        "| plan for the CPU | source |")
  print("|---|---|---|---:|---:|---:|---|")
  for size, over, ref, rows, k, measured, source in H200:
    mcfg = model_config(small.get_config(size)).replace(**over)
    if ref:
      mcfg = mcfg.replace(ops=dataclasses.replace(mcfg.ops, **{n: "reference" for n in ref}))
    plan = lambda b: memory_plan.analytic_plan(mcfg, {"data": 1}, rows, 4096, grad_accum_steps=k,
                                               backend=b)["total_bytes"] / GiB  # noqa: E731
    names = ", ".join([f"{n}={v}" for n, v in over.items()]
                      + [f"ops.{n}=reference" for n in ref]) or "defaults"
    print(f"| {size} | {names} | {k} × ({rows // k} × 4096) | {measured} | "
          f"{plan('gpu'):.1f} ({plan('gpu') / measured:.2f}) | {plan('cpu'):.1f} | {source} |")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--part", choices=("cpu", "h200", "both"), default="both")
  args = ap.parse_args(argv)
  if args.part in ("h200", "both"):
    h200_part()
  if args.part in ("cpu", "both"):
    cpu_part()
  return 0


if __name__ == "__main__":
  sys.exit(main())
