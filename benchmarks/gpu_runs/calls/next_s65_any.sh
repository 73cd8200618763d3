# Session 65's call for either card (~450 s; carry .whl):
#   1. issue 27: the mHC site rows with burst timing (session 64's `time_calls`): the registered
#      kernel's forward+backward against the card's own copy rate, both back to back (~150 s);
#   2. issues 26 and 27: s3 by source at 4 x 4096 (the in-step figures: attention op + indexer
#      <= 60 ms, mHC <= 40, MoE <= 60; H100 session 59: 63.1 / 42.1 / 66.0), with session 59's
#      kept indexer scores (`picked`) and later code never profiled.
#   run(command="bash benchmarks/gpu_runs/calls/next_s65_any.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "site: reference, kernel, copy (bursts)"
timeout -s TERM 150 python3 -u benchmarks/mhc_moe_gpu.py --only=site --copy --reps 20 \
    --budget-s 120 --json=$OUT/site.json 2>&1 \
    | grep -v "^WARNING\|DeprecationWarning\|warnings.warn" | grep "^case="
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -dc 'A-Za-z0-9')
profile s3 "s3_$gpu"
step done
