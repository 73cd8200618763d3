# Session 62: whichever card comes (carry .whl; from the repository root).
#   run(command="bash benchmarks/gpu_runs/calls/next_s62_any.sh", carry=[".whl"], timeout_s=600)
# next_s60_h200.sh on either card. An H200 (> 100 GiB): m3 at 8 x (4 x 4096) (issue 28's 20 %), s3 by
# source (issues 26 and 27 are judged on the H200, which has not run since session 56), m3 by source if
# time is left; then take next_s61_m3prof.sh and next_s61_m3train.sh (needs_h200) on the warm machine.
# An H100: m3 as 32 micro-batches of 1 x 4096 (the same 131K tokens a step; never measured) and s3 by
# source with today's code (the indexer's picked scores kept under remat, untimed since session 59).
# Session 62 got only an H100 and measured the XLA-flag arms there (none faster): this call is
# still the first one to make. On a warm H200 after it (needs_h200): next_s62_m3mb.sh (m3 at 8 x 4096
# a micro-batch: 4 x (8 x 4096) and 8 x (8 x 4096)), next_s61_m3prof.sh, next_s61_m3train.sh.
exec bash benchmarks/gpu_runs/calls/next_s60_h200.sh
