# Session 72's second call (any card, ~560 s): m3, last timed at session 47 (15.5 % MFU on an H200,
# before the expert products in bf16 were the only change since; every later kernel and fusion is
# untimed at m3). On an H200: m3 at 8 x (4 x 4096), issue 28's setting, then by source at one
# 4 x 4096 micro-batch. On an H100 (m3 at 4 x 4096 needs ~81 GiB): 32 x (1 x 4096), the same
# 131,072 tokens a step, then by source at one 1 x 4096 micro-batch.
#   run(command="bash benchmarks/gpu_runs/calls/next_s72b.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  accum m3 "main_$card" 300
  ( PBATCH=4 profile m3 "m3_b4_$card" )
else
  ( MB=1 K=32 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 accum m3 "mb1_$card" 260 )
  ( XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PBATCH=1 profile m3 "m3_b1_$card" )
fi
step done
