# SUPERSEDED by next_s55_call1.sh (the run form is on main since session 54). Was: next H200 session, first call (issue 28, ~560 s; carry .whl; from the repository root): main as of
# session 53 (the Engram split and the bf16 x 6 router from s3 up) at issue 28's settings.
#   s3 main   expected ~2,100 ms (2,175-2,218 before, less ~64 ms for the split and ~30 for the
#             router); 12 % MFU is ~1,996 ms
#   s3 run    s53_engram_run.patch: an Engram layer starts its own run (the parameter layout
#             changes: runs/<r>/... renumbered), so no run's stacks are sliced around the
#             injection. The split slices the encoder run's float32 stacks (~2.7 GB at s3) and
#             concatenates their gradients every micro-batch: ~3 GiB of peak (H100: 43.7 -> 46.7)
#             and perhaps ~20 ms a step; the run form compiles one more body per Engram run
#   m3 main   one row (80.7 GiB before the split: must stay under the H200's 139 GiB)
#   run(command="bash benchmarks/gpu_runs/calls/next_s54_call1.sh", carry=[".whl"], timeout_s=600)
# On an H100 (80 GB: one s3 arm at a time) run the s3 rows one after another with prelude `accum`.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
rm -rf /tmp/tree_run && mkdir -p /tmp/tree_run && cp -a . /tmp/tree_run/ \
  && patch -s -d /tmp/tree_run -p1 < benchmarks/gpu_runs/calls/s53_engram_run.patch || exit 1
arms s3 260 main run@/tmp/tree_run
accum m3 main $(( 585 - SECONDS ))
step done
