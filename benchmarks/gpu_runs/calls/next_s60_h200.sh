# Session 60's H200 call (~450 s; carry .whl; from the repository root). m3's accumulated step needs
# ~81 GiB, more than an H100's 80 GB, so this call may ask for an H200 (run's needs_h200; every call
# of sessions 57-59 came on an H100 and the H200 figures are from session 56):
#   1. issue 28: m3 at 8 x (4 x 4096) on main (MFU against the 20 % asked; 15.5 % at session 47,
#      before cast_weights_once, unfilled_buffers, the X' barrier, the RoPE pass and session 59's
#      indexer defaults);
#   2. issues 26 and 27 on the H200: s3 by source (attention op + indexer <= 60 ms: 63.1 on an H100 at
#      session 59; mHC <= 40: 42.1; MoE <= 60: 66.0), with session 59's profile rules (the Triton
#      select counted in the indexer);
#   3. m3 by source, if time is left (issue 28's profile table for the 3B-class config).
#   run(command="bash benchmarks/gpu_runs/calls/next_s60_h200.sh", carry=[".whl"], timeout_s=600,
#       needs_h200=true)
# On an H100 (if no H200 comes: run it without needs_h200) m3 runs as 32 micro-batches of 1 x 4096
# (the same 131K tokens a step; 4 x 4096 does not fit 80 GB) and its profile is skipped.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then
  MB=1 K=32 accum m3 main_1x32 300
  [ $SECONDS -lt 420 ] && profile s3 s3_h100
else
  accum m3 main 240
  [ $SECONDS -lt 420 ] && profile s3 s3_h200
  [ $SECONDS -lt 400 ] && profile m3 m3_h200
fi
step done
