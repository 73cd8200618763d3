# Session 52 (issue 28, ~520 s; carry .whl; from the repository root): s3's accumulated step
# (8 x (4 x 4096)), two arms at a time compiled at once and timed in turn (prelude `arms`):
#   main, main2   the tree as committed (the Engram injection between two scans of the run, no
#                 lax.cond in the layer body); two rows give the call's noise
#   cond_back     the Engram lax.cond put back (s52_engram_cond_back.patch: session 51's model):
#                 the 2026-12-03 profile charged ~5 ms a micro-batch to the cond's copies and fills
#   router_6x     model.router_precision=bf16_6x on top of main (session 51: -30 ms)
# Compile times are in each arm's row (one more scan body per Engram run: two at s3).
#   run(command="bash benchmarks/gpu_runs/calls/next_s52_perf.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
rm -rf /tmp/tree_cond_back && mkdir -p /tmp/tree_cond_back && cp -a . /tmp/tree_cond_back/ \
  && patch -d /tmp/tree_cond_back -p1 < benchmarks/gpu_runs/calls/s52_engram_cond_back.patch || exit 1
arms s3 250 main cond_back@/tmp/tree_cond_back
arms s3 250 router_6x:model.router_precision=bf16_6x main2
step done
