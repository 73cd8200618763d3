# Issue 28: m3's micro-batch on an H200. At s3 (session 39) the same 131K tokens ran 7.5 % faster as
# 4 micro-batches of 8 x 4096 than as 8 of 4 x 4096 (each micro-batch pays ~25-50 ms of launch-bound
# work that does not shrink with its rows), and the optimizer (~300 ms at m3, once a step) weighs half
# as much at a 262K-token step. m3 was only ever timed as 8 x (4 x 4096) (80.7 GiB); 8 x 4096 rows
# should take ~110 GiB (the activations doubled), which an H200 holds. Two arms, one after the other:
#   4 x (8 x 4096) = 131K tokens (issue 28's setting, a larger micro-batch)
#   8 x (8 x 4096) = 262K tokens (a larger global batch: the optimizer amortised twice as far)
# From the repository root, on a warm H200 (~2 x 250 s):
#   run(command="bash benchmarks/gpu_runs/calls/next_s62_m3mb.sh", carry=[".whl"], timeout_s=600,
#       needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then
  echo "m3 at 8 x 4096 a micro-batch needs ~110 GiB; this card has ${gpu_mib} MiB: not run"; exit 0
fi
MB=8 K=${K1:-4} accum m3 mb8_k${K1:-4} 270
[ $SECONDS -lt 300 ] && MB=8 K=${K2:-8} accum m3 mb8_k${K2:-8} $(( 580 - SECONDS ))
step done
