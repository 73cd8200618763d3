# Next session, after next_s47_perf.sh (issue 28, ~520 s; carry .whl; from the repository root): m3's
# accumulated step (8 x (4 x 4096), bfloat16 streams now its default; 2,833.8 ms, 15.2 % MFU on
# 2026-12-04) with the expert products in bf16 and [a | u] kept under remat. At m3 the routed
# experts' grouped GEMMs are 66 ms of a ~317 ms micro-batch, 2 of their 11 products the remat's
# recompute of [a | u], which `remat_saves=experts` keeps instead (12 layers x [98,304, 1,536] in
# bf16: 3.6 GB more at its 80.7 GiB peak).
#   run(command="bash benchmarks/gpu_runs/calls/next_s47_m3.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
accum m3 base 170
accum m3 compute 170 model.moe_product_dtype=compute
accum m3 compute_saves 170 model.moe_product_dtype=compute model.remat_saves=experts
step done
