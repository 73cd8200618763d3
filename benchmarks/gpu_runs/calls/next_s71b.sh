# Session 71 (any card, ~590 s). On an H200: next_s66_h200a.sh (s3 by source = issues 26/27's in-step
# figures on the card they name; then m3 at 4 x (8 x 4096) for issue 28). On an H100: m3 by source at one
# 1 x 4096 micro-batch (m3 at 4 x 4096 needs ~81 GiB; never profiled since session 46's H200 profile, which
# predates the expert products in bf16, the weights cast once, the rows mHC site and the head loss's
# single logits pass): where issue 28's m3 20 % must come from.
#   run(command="bash benchmarks/gpu_runs/calls/next_s71b.sh", carry=[".whl"], timeout_s=600)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash benchmarks/gpu_runs/calls/next_s66_h200a.sh
fi
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
( SECONDS=15; XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PBATCH=1 profile m3 "m3_b1_$card" )
step done
