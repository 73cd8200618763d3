# Session 68's second call (the warm machine of next_s68_rows.sh): s3 accumulated on main (the
# comparison arm, same card), then s3 by source with the rows kernel as hc_site's kernel.
#   run(command="bash benchmarks/gpu_runs/calls/next_s68_rows_b.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
arms s3 300 main
rows_tree || exit 1
(cd /tmp/tree_rows && profile s3 s3_rows)
step done
