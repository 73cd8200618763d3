# Next session, call 1 (~560 s; carry .whl and build/clean): run from a clean worktree of main
#   git worktree add build/clean HEAD && cp -r .whl build/clean/
#   run(command="cd build/clean && bash benchmarks/gpu_runs/calls/next_s40_call1.sh", carry=[".whl", "build/clean"])
# 1. launch.train at s3, 8 x (4 x 4096), as 2026-12-02d call 4, now with the train loop's look-ahead
#    (data/lookahead.py): that call's steps were 3.95-5.15 s with 1.05-2.25 s of data wait; expected
#    ~2.9 s (gpu_step's 2.75 s plus the ViT) with data wait near 0 and "next batch on the host" ~1.2 s.
#    If data wait stays high, the host is the limit: rerun with --config.data.worker_count=2.
# 2. m3 by source at its micro-batch (issue 28 keeps the table for s3 and m3 in RESULTS.md).
source benchmarks/gpu_runs/calls/prelude.sh
step s3_train50; timeout -s INT 300 python3 -m launch.train --config=configs/small.py:s3 --workdir=/tmp/s3_50 \
    --config.data.batch_size=32 --config.data.seq_len=4096 --config.model.seq_len=4096 \
    --config.train.grad_accum_steps=8 --config.train.steps=50 --config.train.log_every=5 \
    --config.train.eval_every=0 --config.train.checkpoint_every=1000 --config.train.progress_bar=false
cp /tmp/s3_50/metrics.jsonl $OUT/ 2>/dev/null
step prof_m3; timeout -s TERM $((560 - SECONDS)) python3 -u benchmarks/gpu_profile.py --size m3 --batch 4 --seq 4096 --steps 1 --top 60 --out /tmp/prof_m3 --json $OUT/prof_m3.json
step done
