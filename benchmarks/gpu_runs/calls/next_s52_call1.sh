# Session 52, call 1 (never ran: no machine started; issues 27 / 28, ~420 s; carry .whl; from the
# repository root):
#   1. the router's s1 loss A/B, seed 0 (ab_seeds.sh: highest against bf16_6x, both arms at once;
#      its own log in $OUT/ab);
#   2. the s3 profile with model.router_precision=bf16_6x (prelude `profile`; the component and
#      work-kind tables for RESULTS and for what to take next).
#   run(command="bash benchmarks/gpu_runs/calls/next_s52_call1.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
mkdir -p "$OUT/ab"
OUT="$OUT/ab" A='model.router_precision=highest' B='model.router_precision=bf16_6x' NAME_A=highest \
  NAME_B=bf16_6x SEEDS=0 bash benchmarks/gpu_runs/calls/ab_seeds.sh
profile s3 s3_router6x model.router_precision=bf16_6x
step done
