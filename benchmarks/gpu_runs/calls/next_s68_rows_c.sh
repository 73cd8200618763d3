# Session 68's last call (any card, ~150 s): the site rows (reference, kernel, rows at its default tiles
# and two others, -X) after the backward kernel took the mix's cotangent of X' from one XLA product.
#   run(command="bash benchmarks/gpu_runs/calls/next_s68_rows_c.sh", carry=[".whl"], timeout_s=170)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
SITE_SECS=150 site_burst --rows-tiles 8x256w8/16x64w8 8x256w8/32x64w8
