# Session 72 (any card, ~260 s; best on the machine that just ran next_s72.sh, whose `main` arm is the
# baseline): where s3's compile time goes. Issue 28 asks compile <= 90 s; s3's was 74-106 s on H100s
# (sessions 59-71). One arm with XLA's GEMM autotuning off (`--xla_gpu_autotune_level=0`: cuBLAS's
# heuristic algorithm for each of the step's ~209 cuBLAS products, none timed at compile): the compile
# it saves, and what the step pays for it.
#   run(command="bash benchmarks/gpu_runs/calls/next_s72c.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
export XLA_ARM_at0="--xla_gpu_autotune_level=0"
arms s3 ${ARM_SECS:-280} at0 ${MAIN_TOO:+main}
step done
