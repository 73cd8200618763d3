# The next session's first call (any card, ~590 s): m3, last timed at session 47 (15.5 % MFU on an
# H200, with the expert products in bf16; every later kernel and fusion is untimed at m3). On an H200: m3 at 8 x (4 x 4096), issue 28's setting, then by source at one
# 4 x 4096 micro-batch. On an H100 (m3 at 4 x 4096 needs ~81 GiB): 16 x (2 x 4096) (131,072 tokens
# a step), then by source at one 1 x 4096 micro-batch.
#   run(command="bash benchmarks/gpu_runs/calls/next_s72b.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
# On an H100 at 16 micro-batches: issue 28 allows a 131K+-token step; at m3 the optimizer's ~300 ms
# (session 46) is ~11 % of an 8-micro-batch step, so next_s72f.sh also times 16 x (4 x 4096) on an H200.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  accum m3 "k8_$card" 230
  ( PBATCH=4 profile m3 "m3_b4_$card" )   # 16 x (4 x 4096): next_s72f.sh
else
  # 2 x 4096 needs ~76 GiB by the analytic plan (0.99 of the measured peak at 4 x 4096): 97 % of
  # the card. Not at 1 row: each micro-batch adds its gradient tree to the accumulator (~35 GB
  # of traffic at m3, ~10 ms on an H100), so 32 micro-batches would mostly time that.
  ( MB=2 K=16 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 accum m3 "mb2k16_$card" 230 )
  ( XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PBATCH=1 profile m3 "m3_b1_$card" )
fi
step done
