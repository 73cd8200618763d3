# Session 52, call 1 (issues 27 / 28, ~420 s; carry .whl; from the repository root):
#   1. the router's s1 loss A/B, seed 0 (ab_seeds.sh: highest against bf16_6x, both arms at once);
#   2. the s3 profile at HEAD with model.router_precision=bf16_6x (gpu_profile.py, 4 x 4096; the
#      component and work-kind tables for RESULTS and for what to take next).
#   run(command="bash benchmarks/gpu_runs/calls/next_s52_call1.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
A='model.router_precision=highest' B='model.router_precision=bf16_6x' NAME_A=highest NAME_B=bf16_6x \
  SEEDS=0 bash benchmarks/gpu_runs/calls/ab_seeds.sh
step "profile s3 4 x 4096, router bf16_6x (gpu_profile.py turns command buffers off)"
timeout -s TERM $(( 585 - SECONDS )) python3 -u \
    benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 30 --out /tmp/prof_s3 \
    --json "$OUT/prof_s3.json" --set model.router_precision=bf16_6x > "$OUT/profile.txt" 2>&1
sed -n "/component/,/^$/p" "$OUT/profile.txt"; tail -60 "$OUT/profile.txt"
step done
