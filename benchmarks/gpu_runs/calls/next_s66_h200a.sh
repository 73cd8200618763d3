# Session 66's first H200 call (needs_h200; ~580 s): the two figures that could close issues, first.
#   1. issues 26 and 27: s3 by source on the H200 (attention op + indexer <= 60 ms, mHC <= 40, MoE <= 60;
#      the H200 last profiled s3 at session 56; the H100 at session 59 gave 63.1 / 42.1 / 66.0), <= 260 s;
#   2. issue 28: m3 at 4 x (8 x 4096) by gpu_step.py (131K tokens a step at 8-row micro-batches:
#      never measured; ~110-124 GiB expected) with the rest of the call.
# Then, on the warm machine: SKIP_PROFILE=1 bash benchmarks/gpu_runs/calls/next_s65_h200b.sh (m3's
# launch.train; ROWS=4 ACCUM=8 if the 8-row micro-batch did not fit) or next_s62_m3mb.sh with K1=8.
#   run(command="bash benchmarks/gpu_runs/calls/next_s66_h200a.sh", carry=[".whl"], timeout_s=600,
#       kind="nvidia-h200", needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
( SECONDS=325; profile s3 s3_h200 )
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then echo "not an H200 (${gpu_mib} MiB): m3 not run"; step done; exit 0; fi
MB=8 K=4 accum m3 mb8_k4 $(( 585 - SECONDS ))
step done
