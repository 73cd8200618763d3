# 2026-12-02 (fourth session), call 4 (~520 s; carry .whl and build/clean): issue 28's launch.train
# for 50 steps at s3 with 8 micro-batches of 4 x 4096 (131K tokens a step), the loss falling; then
# s3's 131K-token step as 2 x (16 x 4096) beside call 1's 4 x 8 rows and 8 x 4 rows.
source benchmarks/gpu_runs/calls/prelude.sh
step s3_train50; timeout -s INT 350 python3 -m launch.train --config=configs/small.py:s3 --workdir=/tmp/s3_50 \
    --config.data.batch_size=32 --config.data.seq_len=4096 --config.model.seq_len=4096 \
    --config.train.grad_accum_steps=8 --config.train.steps=50 --config.train.log_every=5 \
    --config.train.eval_every=0 --config.train.progress_bar=false
cp /tmp/s3_50/metrics.jsonl $OUT/ 2>/dev/null; ls /tmp/s3_50
step micro_2x16; timeout -s TERM $((575 - SECONDS)) python3 -u benchmarks/gpu_step.py --sizes s3 --batch 16 --grad_accum 2 --seq 4096 --steps 2 --no_split --json $OUT/micro_2x16.json
step done
