# Session 69's first call (ran at 14:15 on an H100; main has run the rows kernel since, so its rows_tree now fails: use next_s70.sh) (any card, ~590 s). On an H200: next_s68_h200.sh (site rows, then s3 by
# source with the faster site kernel). On an H100: the site rows after the rows backward kernel took
# the mix's cotangent from one XLA product (session 68's unmeasured change), then, when rows beats the
# registered kernel forward+backward, s3 accumulated with it swapped in (main's arm on the H100: s67's
# 2,188.5 ms, or the next call's).
#   run(command="bash benchmarks/gpu_runs/calls/next_s69.sh", carry=[".whl"], timeout_s=600)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash benchmarks/gpu_runs/calls/next_s68_h200.sh
fi
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
SITE_SECS=160 site_burst --rows-tiles 8x256w8/16x64w8 8x256w8/32x64w8
faster=$(faster_site "$OUT/site.json")
echo "faster site: $faster"
if [ "$faster" = rows ]; then
  rows_tree || exit 1
  arms s3 $(( 590 - SECONDS )) rows@/tmp/tree_rows
else
  arms s3 $(( 590 - SECONDS )) main
fi
step done
