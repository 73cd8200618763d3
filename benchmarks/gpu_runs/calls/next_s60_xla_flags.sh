# MEASURED in session 62 (one H100; benchmarks/RESULTS.md): notriton 2,214.0, lhs 2,218.2 against main
# 2,208.8-2,219.1 ms (no effect); dbuf 4,837.3 ms (2.2x slower). Kept as the record of how they ran.
# Issue 28: XLA's GPU options that MaxText-style GPU setups change, on s3's accumulated step, one
# arm each against main (either card; ~400 s a call on an H100, where s3 arms run one after
# another; carry .whl; from the repository root). Only `--xla_gpu_enable_command_buffer=` (the
# profiles), region-analysis copy insertion and dynamic-slice fusion (session 53) were ever tried.
# Every flag below parses under jax 0.11.2's XLA (checked on the CPU: an unknown flag aborts at
# start-up; `--xla_gpu_enable_priority_fusion`, `--xla_gpu_enable_split_k_autotuning` and
# `--xla_gpu_enable_reduction_epilogue_fusion` no longer exist):
#   notriton  --xla_gpu_enable_triton_gemm=false: every GEMM fusion on cuBLAS / cuBLASLt (s3's
#             Newton-Schulz Gram products run as Triton GEMM fusions, `gemm_fusion_dot_general`,
#             ~2.1 ms each; the model's projections too)
#   lhs       --xla_gpu_enable_latency_hiding_scheduler=true: the scheduler that orders independent
#             kernels by cost (on one GPU: what it does to the layer scan's streams and memory)
#   dbuf      --xla_gpu_enable_while_loop_double_buffering=true: the layer scans' while loops
#             unrolled by two, so one iteration's tail overlaps the next one's head
# A flag that wins beyond the arms' spread (5-11 ms between calls, ~23 ms shown by session 59's
# indexer arms) becomes a flag the launch sets on the GPU (none is set today), documented with
# this measurement; losses should be bit-equal for lhs and dbuf (same kernels, other order), within
# float rounding for notriton (other GEMM kernels).
# Session 61 ran all four arms on an H100 at 140 s each: every arm hit its timeout (a fresh machine,
# no compilation cache; 562 s of device time, nothing measured). Two arms a call now, 200 s each,
# back to back on one warm machine (the second call's arms are read against the first's main):
#   run(command="bash benchmarks/gpu_runs/calls/next_s60_xla_flags.sh", carry=[".whl"], timeout_s=600)
#   run(command="ARMS='lhs dbuf' bash benchmarks/gpu_runs/calls/next_s60_xla_flags.sh", carry=[".whl"],
#       timeout_s=600)
# (an H200 compiles two s3 arms at once, 63 GiB each; an H100 runs them one after the other)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
export XLA_ARM_notriton=--xla_gpu_enable_triton_gemm=false
export XLA_ARM_lhs=--xla_gpu_enable_latency_hiding_scheduler=true
export XLA_ARM_dbuf=--xla_gpu_enable_while_loop_double_buffering=true
# shellcheck disable=SC2086
arms s3 ${SECS:-200} ${ARMS:-main notriton}
step done
