# Next session, call 1 (~560 s; carry .whl and build/clean, see below): what this session could not measure
# (its device starts were refused four times after call 2). Run from a clean worktree of main so helpers'
# uncommitted edits do not travel:   git worktree add build/clean HEAD && cp -r .whl build/clean/
# and   git show 47bb4d5:dsv41_jax/layers/moe_dispatch.py > build/clean/benchmarks/moe_dispatch_47bb4d5.py
#   run(command="cd build/clean && bash benchmarks/gpu_runs/calls/next_s39_call1.sh", carry=[".whl", "build/clean"])
# 1. The micro-batch size at a fixed 131K-token step (remat on, one process, the state reused): s3 as
#    4 x (8 x 4096) and 8 x (4 x 4096) (16 x (2 x 4096) with remat on in a later call). Call 2 of 2026-12-02c found 16 x 2 rows (remat off)
#    45 % slower than 8 x 4 rows (remat on): if a micro-batch carries a fixed cost, 4 x 8 rows is faster
#    (s3's program at 8 rows: ~80 GiB by call 2's 46 GiB at 4 rows plus ~32 GiB of activations).
# 2. The MoE layer: d5790e3 (one-pass SwiGLU backward, bit-identical) and 701beb6 (expert weights kept
#    under remat; reverted as a likely wash, its row "expert weights cast again" isolates it) against the
#    module before both (benchmarks/moe_dispatch_47bb4d5.py, made above). To measure 701beb6 itself, apply it in the
#    worktree first (git -C build/clean cherry-pick 701beb6) and read the rows "model remat policy" vs
#    "expert weights cast again".
# 3. s3's step by source after this session's commits (mHC after the fused_mix revert is still unconfirmed).
source benchmarks/gpu_runs/calls/prelude.sh
step prof_s3; timeout -s TERM 235 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 1 --top 40 --out /tmp/prof_s3 --json $OUT/prof_s3.json
step micro_s3; timeout -s TERM 200 python3 -u benchmarks/gpu_step.py --sizes s3 s3 --batch 8 4 --grad_accum 4 8 --seq 4096 --steps 2 --no_split --json $OUT/micro_s3.json
step moe; timeout -s TERM $((560 - SECONDS)) python3 -u benchmarks/mhc_moe_gpu.py --only moe --reps 10 --budget-s 60 --baseline-moe=benchmarks/moe_dispatch_47bb4d5.py --json=$OUT/moe.json
step done
