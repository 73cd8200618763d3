# Session 67's fallback call for an H100 (or either card; ~480 s; carry .whl):
#   1. issue 27: the registered mHC site's forward+backward against the card's copy rate, timed in
#      bursts (the benchmark's rows before session 64 included each call's dispatch latency), ~150 s;
#   2. issue 28: s3's accumulated step at 8 x (4 x 4096) (10.7 % MFU on an H100 at session 64; the
#      head loss changed since), the rest of the call.
#   run(command="bash benchmarks/gpu_runs/calls/next_s67_h100.sh", carry=[".whl"], timeout_s=560,
#       kind="nvidia-h100-x1", needs_h200=false)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
site_burst
s3_accum main $(( ${CALL_SECS:-545} - SECONDS ))
step done
