# Session 68's call on an H200 (needs_h200; ~590 s): the rows site kernel against the registered one
# and -X in bursts (issue 27's >= 60 % of copy), then s3 by source (issues 26/27's in-step figures)
# with whichever site kernel was faster forward+backward (the rows one through a tree copy).
#   run(command="bash benchmarks/gpu_runs/calls/next_s68_h200.sh", carry=[".whl"], timeout_s=600,
#       kind="nvidia-h200", needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
SITE_SECS=230 site_burst --rows-tiles 4x256w4/16x32w4 8x256w8/16x64w8
faster=$(faster_site "$OUT/site.json")
echo "faster site: $faster"
if [ "$faster" = rows ]; then
  rows_tree || exit 1
  (cd /tmp/tree_rows && profile s3 s3_h200_rows)
else
  profile s3 s3_h200
fi
step done
