# Session 72, the short form of next_s72b.sh (~300 s, for a low budget): m3's accumulated step only,
# no profile. H200: 8 x (4 x 4096); H100: 16 x (2 x 4096) (both 131,072 tokens a step).
#   run(command="bash benchmarks/gpu_runs/calls/next_s72g.sh", carry=[".whl"], timeout_s=330)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  accum m3 "k8_$card" $(( 315 - SECONDS ))
else
  ( MB=2 K=16 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 accum m3 "mb2k16_$card" $(( 315 - SECONDS )) )
fi
step done
