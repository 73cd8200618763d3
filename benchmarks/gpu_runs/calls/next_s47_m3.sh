# Next session, after next_s47_perf.sh (issue 28, ~520 s; carry .whl; from the repository root): m3's
# accumulated step (8 x (4 x 4096), bfloat16 streams now its default; 2,833.8 ms, 15.2 % MFU on
# 2026-12-04) with the expert products in bf16 and [a | u] kept under remat. At m3 the routed
# experts' grouped GEMMs are 66 ms of a ~317 ms micro-batch, 2 of their 11 products the remat's
# recompute of [a | u], which `remat_saves=experts` keeps instead (12 layers x [98,304, 1,536] in
# bf16: 3.6 GB more at its 80.7 GiB peak).
#   run(command="bash benchmarks/gpu_runs/calls/next_s47_m3.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
m3_accum() {
  local name=$1; shift
  step "m3 8 x (4 x 4096): $name"
  timeout -s TERM 170 python3 -u benchmarks/gpu_step.py --sizes m3 --batch 4 --seq 4096 \
      --grad_accum 8 --steps 2 --no_split --json "$OUT/m3_$name.json" ${1:+--set "$@"} | tail -3
}
m3_accum base
m3_accum compute model.moe_product_dtype=compute
m3_accum compute_saves model.moe_product_dtype=compute model.remat_saves=experts
step done
