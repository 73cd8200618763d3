# Session 71's first call (any card, ~590 s). On an H200: next_s66_h200a.sh (s3 by source on main =
# issues 26/27's in-step figures, unmeasured on an H200 since session 56; then m3 at 4 x (8 x 4096) for
# issue 28). On an H100: the rows backward tiles in the accumulated s3 step in the order session 70 did
# not run (8 x 64, 4 first, then main's 32 x 64, 8: session 70 had main first, 2,182.9 vs 2,236.4 ms, while
# its profile put the backward kernel at 0.351 ms a call against 0.296 at 8 x 64, 4 on another H100).
#   run(command="bash benchmarks/gpu_runs/calls/next_s71.sh", carry=[".whl"], timeout_s=600)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash benchmarks/gpu_runs/calls/next_s66_h200a.sh
fi
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_copy bwd8x64 pallas_kernels/mhc_rows.py 's|^BWD_TILES = (32, 64, 8)|BWD_TILES = (8, 64, 4)|' || exit 1
arms s3 280 bwd8x64@/tmp/tree_bwd8x64 main
step done
