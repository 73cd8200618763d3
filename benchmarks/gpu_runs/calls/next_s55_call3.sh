# Next session, third call (issues 26, 27, 28: the component table on the H200; ~300 s each; carry
# .whl; from the repository root). Session 54's table is the H100's (s54_call4: optimizer 139.0,
# attention 68.8, MoE 67.4, dense 56.4, mHC 30.8, indexer 14.7 ms at one 4 x 4096 step). On the
# H200 it decides issue 27's MoE (<= 60 ms; ~58-62 before the bf16 x 6 router, which took ~3.7 ms
# off) and issue 26's attention + indexer (<= 60 ms). m3's profile follows if time is left
# (command buffers off: m3 compiled in 91.8 s that way in session 46).
#   run(command="bash benchmarks/gpu_runs/calls/next_s55_call3.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
profile s3 s3_h200
[ $SECONDS -lt 300 ] && profile m3 m3_h200
step done
