# Session 68's first call (any card; ~580 s): the stream-pass site kernel (pallas_kernels/mhc_rows.py)
# against the registered kernel and -X at s3's shapes in bursts, at its default tiles and three others,
# then s3 accumulated (8 x (4 x 4096)) with the dispatcher's hc_site kernel swapped for it (a tree copy).
#   run(command="bash benchmarks/gpu_runs/calls/next_s68_rows.sh", carry=[".whl"], timeout_s=600)
# Then, on the warm machine: next_s68_rows_b.sh (s3 accumulated on main, the same card; s3 by source
# with the rows kernel).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
SITE_SECS=250 site_burst --rows-tiles 4x256w4/16x32w4 4x512w4/8x32w2 8x256w8/16x64w8
rows_tree || exit 1
arms s3 $(( 590 - SECONDS )) rows@/tmp/tree_rows
step done
