# Next session, call 2 (~340 s; carry .whl): s3 by launch.train for 50 steps at the config's own batch
# (131K tokens a step: 8 micro-batches of 8 x 2048), the loss falling (issue 28's done-when).
source benchmarks/gpu_runs/calls/prelude.sh
step s3_train50; timeout -s INT 330 python3 -m launch.train --config=configs/small.py:s3 --workdir=/tmp/s3_50 \
    --config.train.steps=50 --config.train.log_every=5 --config.train.eval_every=0
cp /tmp/s3_50/metrics.jsonl /tmp/s3_50/train.log $OUT/ 2>/dev/null
step done
