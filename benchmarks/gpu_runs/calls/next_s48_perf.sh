# Next session (issues 26 and 28, ~500 s; carry .whl; from the repository root): s3's accumulated step
# (8 x (4 x 4096); bfloat16 streams and compute-dtype expert products are s3's defaults since
# session 47) with one kernel default changed in a copy of the tree each, two arms at a time compiled
# at once and timed in turn (prelude `arms`, gpu_step.py --turn):
#   main, main2    the tree as committed (indexer scores tile 64 x 128: 1.13 ms standalone against
#                  1.49 for 64 x 64, session 47); two rows give the call's own noise
#   idx_n64        the old indexer tile, 64 x 64: does the new one shorten the step?
#   fwd_bk128      sparse_attend's forward slot block 128 (standalone forward 0.91 ms vs 1.05-1.17)
#   stages3        sparse_attend's kernels with 3 pipeline stages (forward + backward 2.86 vs 3.02)
#   bk128_stages3  both
#   run(command="bash benchmarks/gpu_runs/calls/next_s48_perf.sh", carry=[".whl"], timeout_s=600)
# A winner beyond the main rows' spread becomes the default (csa2_attention.sparse_attend, its
# docstring and RESULTS), then the s3 profile (`gpu_profile.py --size s3 --batch 4 --seq 4096`).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
SA=pallas_kernels/csa2_attention.py
BK='s/block_k: int | None = None,/block_k: int | None = 128,/'
ST='s/num_stages: int = 2, fused_probs/num_stages: int = 3, fused_probs/'
tree_copy idx_n64 pallas_kernels/indexer.py 's/block_n: int = 128/block_n: int = 64/' || exit 1
tree_copy fwd_bk128 $SA "$BK" || exit 1
tree_copy stages3 $SA "$ST" || exit 1
tree_copy bk128_stages3 $SA "$BK; $ST" || exit 1
arms s3 240 main idx_n64@/tmp/tree_idx_n64
arms s3 240 fwd_bk128@/tmp/tree_fwd_bk128 stages3@/tmp/tree_stages3
[ $SECONDS -lt 330 ] && arms s3 240 bk128_stages3@/tmp/tree_bk128_stages3 main2
step done
