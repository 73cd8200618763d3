# Session 72, the smallest call (~190 s, Hopper): the weight gradient 1wg vs 2wg at s3's two expert
# shapes only (next_s72d.sh does all four).
#   run(command="bash benchmarks/gpu_runs/calls/next_s72j.sh", carry=[".whl"], timeout_s=200)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "grouped GEMM weight gradient, 1wg vs 2wg, s3 shapes"
timeout -s TERM $(( 185 - SECONDS )) python3 -u benchmarks/grouped_ws_gpu.py --products weight_grad \
    --cases s3_gate_up,s3_down --reps 10 --out "$OUT" 2>&1 | grep -v "^ *File\|^    " | tail -24
step done
