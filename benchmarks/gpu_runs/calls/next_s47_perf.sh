# Next session (issue 27 item 2, ~480 s; carry .whl; from the repository root): s3's accumulated step
# (8 x (4 x 4096), bfloat16 streams now its default) with the expert products' outputs in bf16
# (`model.moe_product_dtype=compute`, docs/design.md §8.2) and, since [a | u] is then half the bytes,
# with it kept under remat (`model.remat_saves=experts`; 2026-12-02c found no gain with float32
# [a | u]). Side by side in one call:
#   run(command="bash benchmarks/gpu_runs/calls/next_s47_perf.sh", carry=[".whl"], timeout_s=600)
# If `compute` is faster: its s1 loss A/B (ab_seeds.sh, A='model.moe_product_dtype=float32'
# B='model.moe_product_dtype=compute', seeds 0-3 over two calls), then m3 and the profile.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
s3_accum base 170
s3_accum compute 170 model.moe_product_dtype=compute
s3_accum compute_saves 170 model.moe_product_dtype=compute model.remat_saves=experts
step done
