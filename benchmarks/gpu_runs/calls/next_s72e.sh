# Session 72 (Hopper, ~590 s), after next_s72d.sh: the warp-specialized weight gradient in the
# accumulated s3 step, side by side with main (one arm after the other on an H100): main first, then
# the tree whose `Plan.weight_grad` is WG (default: 2wg 128 x 2·128, k64, 4 deep); ORDER=ws for the
# other order.
#   run(command="bash benchmarks/gpu_runs/calls/next_s72e.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
WG=${WG:-"TileConfig(max_concurrent_steps=4, compute_wgs=2)"}
tree_copy wsw pallas_kernels/grouped_matmul.py "s|weight_grad: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=1)|weight_grad: TileConfig = $WG|" || exit 1
if [ "${ORDER:-main}" = ws ]; then
  arms s3 $(( (585 - SECONDS) / 2 )) wsw@/tmp/tree_wsw main
else
  arms s3 $(( (585 - SECONDS) / 2 )) main wsw@/tmp/tree_wsw
fi
step done
