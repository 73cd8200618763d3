# Session 72, low budget (~470 s): next_s72d.sh's weight-gradient comparison cut to 200 s (s3's two
# shapes, then m3's as time allows), then m3's step (H200: 8 x (4 x 4096); H100:
# 16 x (2 x 4096)) in the rest.
#   run(command="bash benchmarks/gpu_runs/calls/next_s72h.sh", carry=[".whl"], timeout_s=500)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
step "grouped GEMM weight gradient, 1wg vs 2wg"
timeout -s TERM 200 python3 -u benchmarks/grouped_ws_gpu.py --products weight_grad \
    --reps 10 --out "$OUT" 2>&1 | grep -v "^ *File\|^    " | tail -30
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  accum m3 "k8_$card" $(( 470 - SECONDS ))
else
  ( MB=2 K=16 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 accum m3 "mb2k16_$card" $(( 470 - SECONDS )) )
fi
step done
