# Ran once (session 59, s59_kernels/); a record now: `--fused-variants` left with the fused site
# (in git history at 8873ae8), so step 1 no longer runs.
# Session 58's kernels, timed side by side on either card (~560 s; carry .whl; from the repository root):
#   1. issue 27: the fused single-pass mHC site (`pallas_kernels/mhc_site.py`: forward and backward
#      each one Triton kernel) against the op's reference and today's kernel (`pallas_kernels.mhc`),
#      forward and forward + backward at s3 with bfloat16 streams, bytes against 4.3 TB/s (60 % of
#      copy asked: ~0.40 ms forward + backward), at its default tiles (64 tokens x 32 channels, 8
#      warps, 2 stages) and four others. If one wins, register it as the op's kernel (the
#      registration the helper wrote is in the session-58 note; tests/pallas_kernels/test_coverage.py
#      wants one batched kernel an op, so replace `pallas_kernels.mhc:hc_site` rather than add),
#      then time s3's step with it (arms s3 ... main fused@tree).
#   2. issue 26: the Triton select stopping its digits early (`early_exit`; ~16.5 of 32 reductions on
#      indexer-like scores, counted on the CPU) and the scores kernel over entry chunks
#      (`block_chunk` 512 / 1024 / 2048: more, more even programs than one a causal query block).
#      If they win, make them the defaults (indexer select "auto" -> "triton_early"; block_chunk).
#   run(command="bash benchmarks/gpu_runs/calls/next_s59_kernels.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "mHC site: reference, kernel, fused at five tiles (bfloat16 streams)"
PYTHONUNBUFFERED=1 timeout -s TERM 300 python3 -u benchmarks/mhc_moe_gpu.py --only=site --reps 20 \
    --budget-s 270 --fused-variants=16x64x8x2,16x32x4x2,32x16x8x2,64x16x8x2 --json=$OUT/site.json
step "indexer: early-exit select, scores over entry chunks"
OUT=$OUT timeout -s TERM $(( 585 - SECONDS )) python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 \
    --deadline $(( 560 - SECONDS )) --cases check,topk-4k,idx-4k-chunks,idx-4k | grep -v "^ROW"
step done
