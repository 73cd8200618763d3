# Session 72, last budget (~300 s): on an H200 m3's step at issue 28's setting (8 x (4 x 4096));
# on an H100 the warp-specialized weight gradient against the single-warpgroup one (next_s72d.sh).
#   run(command="bash benchmarks/gpu_runs/calls/next_s72i.sh", carry=[".whl"], timeout_s=310)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  accum m3 "k8_$card" $(( 295 - SECONDS ))
else
  step "grouped GEMM weight gradient, 1wg vs 2wg"
  timeout -s TERM $(( 295 - SECONDS )) python3 -u benchmarks/grouped_ws_gpu.py --products weight_grad \
      --reps 10 --out "$OUT" 2>&1 | grep -v "^ *File\|^    " | tail -30
fi
step done
