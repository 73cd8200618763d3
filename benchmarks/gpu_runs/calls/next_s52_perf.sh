# Superseded (session 53): the split is on main since aa10698, so its patch no longer applies to
# main and this script stops at the patch; next_s54_call1.sh measures what is left.
# Session 52 (issue 28, ~520 s; carry .whl; from the repository root): s3's accumulated step
# (8 x (4 x 4096)), two arms at a time compiled at once and timed in turn (prelude `arms`):
#   main, main2   the tree as committed (the Engram injection under lax.cond in every layer of its
#                 run); two rows give the call's noise
#   split         s52_engram_split.patch: the injection between two scans of the run (no cond in
#                 the body). The 2026-12-03 profile charged ~5 ms a micro-batch to the cond's
#                 copies and zero-filled residuals; on the CPU the split program needs more
#                 temporaries (s1 4 x 1024: 3.95 -> 6.12 GiB, as session 50's form did): its peak
#                 column says what the GPU's buffer assignment makes of it
#   router_6x     model.router_precision=bf16_6x (session 51: -30 ms)
#   run(command="bash benchmarks/gpu_runs/calls/next_s52_perf.sh", carry=[".whl"], timeout_s=600)
# PAIRS=1 runs the first pair only (main, split: ~300 s with the machine's start).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
rm -rf /tmp/tree_split && mkdir -p /tmp/tree_split && cp -a . /tmp/tree_split/ \
  && patch -d /tmp/tree_split -p1 < benchmarks/gpu_runs/calls/s52_engram_split.patch || exit 1
arms s3 250 main split@/tmp/tree_split
[ "${PAIRS:-2}" = 1 ] || arms s3 250 router_6x:model.router_precision=bf16_6x main2
step done
