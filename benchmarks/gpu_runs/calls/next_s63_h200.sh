# Session 63's first H200 call (~560 s; carry .whl; from the repository root; needs_h200):
#   1. issue 28: m3 at 4 x (8 x 4096) = 131K tokens a step (the larger micro-batch of
#      next_s62_m3mb.sh's first arm: s3 ran 7.5 % faster at 8-row micro-batches than at 4, session 39);
#   2. issues 26 and 27: s3 by source on the H200 (attention op + indexer <= 60 ms, mHC <= 40, MoE <= 60;
#      the H200 last profiled s3 at session 56, the H100 at session 59: 63.1 / 42.1 / 66.0).
# Then, on the warm machine: next_s63_h200b.sh (m3 8 x (4 x 4096) beside it, and launch.train).
#   run(command="bash benchmarks/gpu_runs/calls/next_s63_h200.sh", carry=[".whl"], timeout_s=600,
#       needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then
  echo "an H100 (${gpu_mib} MiB): m3 does not fit; s3 by source only"
  profile s3 s3_h100
else
  MB=8 K=4 accum m3 mb8_k4 280
  [ $SECONDS -lt 380 ] && profile s3 s3_h200
fi
step done
