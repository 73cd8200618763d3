# Session 44 (issues 27 / 28), one call (~400 s; carry .whl; run from the repository root):
# s3's accumulated step (8 micro-batches of 4 x 4096, issue 28's setting) side by side, three
# variants in one call, each its own process:
#   base      main as it is (float32 streams, the indexer's scores_at in chunks of 512 queries)
#   bf16      model.hc_stream_dtype=bfloat16 (docs/design.md §3.5: the mHC streams stored in
#             bfloat16, the site math in float32): half the bytes of the streams' ~8 reads and
#             writes a site (s3: [4, 4096, 4, 1024] float32 = 268 MB each)
#   qchunk    model.index_query_chunk=4096: the indexer's scores_at kernels once a row instead of
#             8 chunks (fewer kernels a micro-batch; the slot gradients are 1.3 GB at 4 x 4096)
#   run(command="bash benchmarks/gpu_runs/calls/next_s44_perf.sh", carry=[".whl"], timeout_s=600)
# Compare the "step ms" of each (2 steps, median) against base in the same call; earlier:
# 2,745.9 ms (RESULTS "The micro-batch's fixed cost", 2026-12-02d).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
one() {  # $1 name, $2 seconds, rest: --set items
  local name=$1 secs=$2; shift 2
  step "s3 8 x (4 x 4096): $name"
  timeout -s TERM "$secs" python3 -u benchmarks/gpu_step.py --sizes s3 --batch 4 --seq 4096 \
      --grad_accum 8 --steps 2 --no_split --json "$OUT/s3_$name.json" ${1:+--set "$@"} | tail -4
}
one base 170
one bf16 170 model.hc_stream_dtype=bfloat16
one qchunk $(( 590 - SECONDS )) model.index_query_chunk=4096
step done
