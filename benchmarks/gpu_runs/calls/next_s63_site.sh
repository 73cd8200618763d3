# Run at session 64 (2026-12-07, an H100, main e4c11d9); the streaming kernel was removed after it (slower).
# Issue 27's site bandwidth: the streaming mHC site kernel (`pallas_kernels/mhc_stream.py`, one
# program per (token block, d-slice)) against the registered kernel and the reference, standalone at
# s3's shapes at three more tilings and the machine's copy rate, then s3's accumulated step with the
# dispatcher's `hc_site` kernel pointed at it (a tree copy), if time is left. Either card.
#   run(command="bash benchmarks/gpu_runs/calls/next_s63_site.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "site: reference, kernel, stream (+ tiles), copy"
timeout -s TERM ${SITE_SECS:-190} python3 -u benchmarks/mhc_moe_gpu.py --only=site --copy --reps 20 \
    --budget-s $(( ${SITE_SECS:-190} - 40 )) --stream-variants=${VARIANTS:-32x128w4,16x128w8,32x256w8} \
    --json=$OUT/site.json 2>&1 | grep -v "^WARNING\|DeprecationWarning\|warnings.warn" | tail -40
# s3's accumulated step, main and the stream kernel as the dispatcher's hc_site kernel: on an H100
# one arm after the other, ~180 s each (session 62: two arms in 353 s).
# ONLY_STREAM=1: the stream arm alone (a short call; main's arm from another call on the same card).
ARMS=(main stream@/tmp/tree_stream); [ -n "$ONLY_STREAM" ] && ARMS=(stream@/tmp/tree_stream)
if [ -z "$NO_STEP" ] && [ $SECONDS -lt 215 ]; then
  tree_copy stream pallas_kernels/dispatch.py \
      's/"pallas_kernels.mhc:hc_site"/"pallas_kernels.mhc_stream:hc_site"/' &&
  arms s3 $(( (${CALL_SECS:-590} - SECONDS) / ${#ARMS[@]} )) "${ARMS[@]}"
fi
step done
