# Session 72's first call (any card, ~590 s). On an H200: next_s66_h200a.sh (s3 by source on main =
# issues 26/27's in-step figures, now with the warp-specialized grouped GEMM; then m3 at 4 x (8 x 4096)
# for issue 28). On an H100: the warp-specialized grouped GEMM in the accumulated s3 step, side by
# side: the single-warpgroup tree first, then main (session 71 timed only main's kernels' arm:
# 2,177.6 ms); the next H100 call should run the other order (ORDER=main).
#   run(command="bash benchmarks/gpu_runs/calls/next_s72.sh", carry=[".whl"], timeout_s=600)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash benchmarks/gpu_runs/calls/next_s66_h200a.sh
fi
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_copy wg1 pallas_kernels/grouped_matmul.py 's|forward_narrow: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2)|forward_narrow: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=2)|; s|input_grad: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2) |input_grad: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=2) |' || exit 1
grep -n "grid_block_n=2)  *# bf16 out" /tmp/tree_wg1/pallas_kernels/grouped_matmul.py
if [ "${ORDER:-wg1}" = main ]; then
  arms s3 $(( (585 - SECONDS) / 2 )) main wg1@/tmp/tree_wg1
else
  arms s3 $(( (585 - SECONDS) / 2 )) wg1@/tmp/tree_wg1 main
fi
step done
