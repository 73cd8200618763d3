# Session 73's first call (any Hopper card, ~590 s): the in-step figures that could close issues 26
# and 27 (s3 by source with session 71's 2wg row products: attention op + indexer <= 60 ms, mHC <= 40,
# MoE <= 60; last profiled on an H100 at session 70: 61.8 / 41.3 / 65.2), then issue 28's m3 (untimed
# since session 47): on an H200 at 8 x (4 x 4096); on an H100 at 16 x (2 x 4096), 97 % of the card.
#   run(command="bash benchmarks/gpu_runs/calls/next_s73.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
( SECONDS=335; profile s3 "s3_$card" )            # at most 250 s
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  accum m3 "k8_$card" $(( 588 - SECONDS ))
else
  ( MB=2 K=16 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 accum m3 "mb2k16_$card" $(( 588 - SECONDS )) )
fi
step done
