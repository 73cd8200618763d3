# Next session (issue 26, ~330 s; carry .whl; from the repository root): the deterministic CSA2
# kernel's tiles and launch settings at s3's shapes (4 x 4096, m 1, H 16, D 128, window 128, top-256),
# one change from the defaults each, forward and forward + backward: never run on the GPU so far.
# In the s3 step (2026-12-03 profile) its dq kernel takes 16.5 ms a micro-batch, the forward 13.0,
# the window band 4.3 and the entry sums 3.6 (18 global layers); then the indexer scores kernel's
# tiles (block_t, block_n, warps; issue 26 asks its forward at 5x the reference's, 3.0x now). A setting that wins here goes
# into `csa2_attention.sparse_attend`'s defaults, then the s3 step side by side.
#   run(command="bash benchmarks/gpu_runs/calls/next_s47_csa2_tiles.sh", carry=[".whl"], timeout_s=420)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "csa2 tiles and launch settings"
OUT=$OUT timeout -s TERM 360 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 330 \
    --cases 4k-m1-tiles,4k-m1-launch,idx-4k-tiles | grep -v "^ROW"
step done
