# Session 71, short call (any card, ~240 s): the warp-specialized grouped GEMM standalone only
# (benchmarks/grouped_ws_gpu.py at s3's and m3's expert shapes); next_s72.sh times the s3 step side by side.
#   run(command="bash benchmarks/gpu_runs/calls/next_s71e.sh", carry=[".whl"], timeout_s=300)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "grouped GEMM row kernels: 1wg vs 2wg"
timeout -s TERM 200 python3 -u benchmarks/grouped_ws_gpu.py --reps 10 --out "$OUT"
step done
