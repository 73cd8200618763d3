# Next session (issues 27 / 28, ~560 s; carry .whl; from the repository root): s3's accumulated step
# after session 44 (e50d0b9: the indexer's scores_at over the whole 4 x 4096 row; d966063: the
# parameters' finite select fused with p + u), with float32 and with bfloat16 streams side by side,
# then the profile by component with bfloat16 streams (RESULTS keeps that table after every
# performance change; the last, float32 streams, is 2026-12-02d's).
#   run(command="bash benchmarks/gpu_runs/calls/next_s45_perf.sh", carry=[".whl"], timeout_s=600)
# Expected: base ~2.70 s (session 44's qchunk row, 2,701.4 ms, less ~6 ms of the select), bf16
# ~2.23 s (10.6 % MFU). If the s1 loss A/B (next_s45_bf16_ab.sh) is within seed noise, make
# hc_stream_dtype="bfloat16" s3's and m3's default in configs/small.py.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
one() {  # $1 name, $2 seconds, rest: --set items
  local name=$1 secs=$2; shift 2
  step "s3 8 x (4 x 4096): $name"
  timeout -s TERM "$secs" python3 -u benchmarks/gpu_step.py --sizes s3 --batch 4 --seq 4096 \
      --grad_accum 8 --steps 2 --no_split --json "$OUT/s3_$name.json" ${1:+--set "$@"} | tail -4
}
one base 160
one bf16 160 model.hc_stream_dtype=bfloat16
step "profile s3 4 x 4096, bfloat16 streams"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -s TERM $(( 585 - SECONDS )) python3 -u \
    benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 30 --out /tmp/prof_s3 \
    --json "$OUT/prof_s3_bf16.json" --set model.hc_stream_dtype=bfloat16 | tail -60
step done
