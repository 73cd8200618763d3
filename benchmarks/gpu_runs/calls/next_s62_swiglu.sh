# Issue 27, item 2: the routed experts' gate/up grouped GEMM with the clamped SwiGLU x routing weight
# in its epilogue (`pallas_kernels/grouped_swiglu.py`, op `grouped_swiglu`), never yet run on a GPU
# (interpret mode on the CPU only). On an H100 the separate SwiGLU fusion costs 6.9 ms of s3's
# ~400 ms micro-batch (it reads [P, 2F] and writes [P, F] in the forward, the remat forward and the
# backward). Either card, ~2 x 250 s on an H100 (one s3 arm after the other), less on an H200:
#   1. standalone at s3's shapes (65,536 sorted pairs, 1024 -> 2 x 512, 48 experts, bf16 [a | u]):
#      the grouped GEMM + XLA SwiGLU against the fused kernel, forward and forward+backward, with
#      TFLOP/s, bytes and the largest relative difference (expected ~0: the same [a | u] and math).
#      A lowering error here (the row-weight broadcast, two accumulators a step) is the first thing
#      to read: the rows say which variant failed and the other still runs.
#   2. s3's accumulated step, today's path against the fused kernel (`model.ops.grouped_swiglu`).
# If the fused arm is faster, let the op's `faster` rule in pallas_kernels/dispatch.py take the
# kernel on the GPU (citing these numbers in benchmarks/RESULTS.md) so that "auto" runs it.
#   run(command="bash benchmarks/gpu_runs/calls/next_s62_swiglu.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "routed experts: grouped GEMM + XLA SwiGLU vs the fused kernel (s3 shapes)"
PYTHONUNBUFFERED=1 timeout -s TERM 150 python3 -u benchmarks/mhc_moe_gpu.py --only=swiglu --reps 20 \
    --budget-s 120 --json=$OUT/swiglu.json | grep -v "^{"
arms s3 $(( (580 - SECONDS) / 2 )) main fused:model.ops.grouped_swiglu=kernel
step done
