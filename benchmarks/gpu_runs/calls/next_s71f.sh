# Session 71, after next_s71e.sh on a warm machine (~400 s): the accumulated s3 step with the
# warp-specialized grouped GEMM (forward_narrow and input_grad: 2wg 128 x 2x128, k64, 4 deep) against
# main, one arm after the other on an H100 (SECS each), together on an H200.
#   run(command="bash benchmarks/gpu_runs/calls/next_s71f.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_copy ws pallas_kernels/grouped_matmul.py 's|forward_narrow: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=2)|forward_narrow: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2)|; s|input_grad: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=2) |input_grad: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2) |' || exit 1
grep -n "compute_wgs=2)" /tmp/tree_ws/pallas_kernels/grouped_matmul.py
arms s3 ${ARM_SECS:-200} ws@/tmp/tree_ws main
step done
