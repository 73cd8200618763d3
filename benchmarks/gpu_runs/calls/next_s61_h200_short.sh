# Session 61's H200 call with ~400 s of device time left (carry .whl; from the repository root):
# s3 by source first (issues 26 and 27 are judged on the H200, which has never run session 59's
# defaults), then m3's accumulated step (issue 28) if the time left allows it.
#   run(command="bash benchmarks/gpu_runs/calls/next_s61_h200_short.sh", carry=[".whl"],
#       timeout_s=420, needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
LIMIT=${LIMIT:-400}
profile s3 s3_h200
left=$(( LIMIT - SECONDS - 10 ))
if [ "$left" -gt 150 ]; then
  accum m3 main "$left"
else
  step "m3 skipped: $left s left"
fi
step done
