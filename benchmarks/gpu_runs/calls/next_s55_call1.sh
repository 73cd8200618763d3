# Next session, first call (issue 28, ~560 s; carry .whl; from the repository root): main as of
# session 54 (an Engram layer starts its own run; the bf16 x 6 router from s3 up).
#   H200: s3 main once (expected ~2,040 ms, ~11.7 %: 2,175-2,218 before sessions 53-54, less ~64 ms
#         for the Engram split, ~30 for the router, ~42 for the run form; 12 % is ~1,996 ms), then
#         m3 main (80.7 GiB before; fit, MFU and compile, which must stay <= 90 s).
#   H100: `accum` skips m3 (it does not fit 80 GB); the s3 row alone is the H100 baseline
#         (2,450 / 2,456 ms in session 54), so follow with the ablations (next4.sh) instead.
#   run(command="bash benchmarks/gpu_runs/calls/next_s55_call1.sh", carry=[".whl"], timeout_s=600)
# then next_s55_call2.sh (m3 at larger micro-batches, H200 only).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
accum s3 main 250
accum m3 main $(( 585 - SECONDS ))
step done
