# Session 55's second H200 call (carry .whl; from the repository root): s3's component table with
# session 55's profile rules (block.py's calls into mHC, the attention and the indexer loss by
# function: the first table where mHC holds the collapse and the output combine), which decides
# issues 26 (attention + indexer <= 60 ms) and 27 (mHC <= 40, MoE <= 60) on the H200; then m3's
# accumulated step on main (80.7 GiB; its MFU against issue 28's 20 %) if time is left.
#   run(command="bash benchmarks/gpu_runs/calls/next_s55_h200.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
profile s3 s3_h200
[ $SECONDS -lt 380 ] && accum m3 main $(( 585 - SECONDS ))
step done
