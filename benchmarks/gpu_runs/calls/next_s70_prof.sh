# Session 70, short call (any card, ~330 s): s3 by source on main (the rows site kernel with its
# backward tiles 32 x 64, 8: session 69's profile ran 8 x 64, 4), issues 26 / 27's in-step rows.
#   run(command="bash benchmarks/gpu_runs/calls/next_s70_prof.sh", carry=[".whl"], timeout_s=400)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
( SECONDS=200; profile s3 "s3_$card" )
step done
