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
[ "${BASE:-1}" = 0 ] || s3_accum base 160  # BASE=0 skips it when device time is short
s3_accum bf16 160 model.hc_stream_dtype=bfloat16
step "profile s3 4 x 4096, bfloat16 streams (gpu_profile.py turns command buffers off)"
timeout -s TERM $(( 585 - SECONDS )) python3 -u \
    benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 30 --out /tmp/prof_s3 \
    --json "$OUT/prof_s3_bf16.json" --set model.hc_stream_dtype=bfloat16 > "$OUT/profile.txt" 2>&1
sed -n "/component/,/^$/p" "$OUT/profile.txt"; tail -40 "$OUT/profile.txt"
step done
