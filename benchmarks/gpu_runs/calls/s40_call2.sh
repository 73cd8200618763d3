# 2026-12-03, call 2 (~260 s; carry .whl and build/clean): launch.train at s3, 8 x (4 x 4096), with the
# look-ahead's peek on a background thread started before the dispatch. Call 1 (peek after the
# dispatch, on the loop's thread) ran 3.9-4.35 s steps with 0-0.85 s data wait: step ~ device + peek,
# so the dispatch itself waited for the device. Expected: dispatch ~ step, step ~2.9-3.1 s.
source benchmarks/gpu_runs/calls/prelude.sh
step s3_train; timeout -s INT 240 python3 -m launch.train --config=configs/small.py:s3 --workdir=/tmp/s3_t \
    --config.data.batch_size=32 --config.data.seq_len=4096 --config.model.seq_len=4096 \
    --config.train.grad_accum_steps=8 --config.train.steps=24 --config.train.log_every=4 \
    --config.train.eval_every=0 --config.train.checkpoint_every=1000 --config.train.progress_bar=false
cp /tmp/s3_t/metrics.jsonl $OUT/ 2>/dev/null
step done
