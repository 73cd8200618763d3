# Session 70's first call (any card, ~590 s). On an H200: next_s66_h200a.sh (s3 by source on main, now
# with the rows site kernel: issues 26/27's in-step figures, unmeasured on an H200 since session 56;
# then m3 at 4 x (8 x 4096) for issue 28). On an H100: s3 accumulated, main (rows site, backward tiles
# 32 x 64, 8 since session 69) against the earlier site kernel, one after the other on the same card.
#   run(command="bash benchmarks/gpu_runs/calls/next_s70.sh", carry=[".whl"], timeout_s=600)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash benchmarks/gpu_runs/calls/next_s66_h200a.sh
fi
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
earlier_site_tree || exit 1
arms s3 280 main earlier_site@/tmp/tree_earlier_site
step done
