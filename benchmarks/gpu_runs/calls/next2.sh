# Next session, call 2 (~560 s; carry .whl): s3 by launch.train for 50 steps at the config's own batch
# (131K tokens a step: 8 micro-batches of 8 x 2048), the loss falling (issue 28's done-when); then the
# optimizer with Newton-Schulz on the spec's schedule and on Polar Express (issue 25; RESULTS "Polar
# Express beside the spec's 8 + 2 schedule": the loss A/B on s1 follows only if it is faster).
source benchmarks/gpu_runs/calls/prelude.sh
step s3_train50; timeout -s INT 330 python3 -m launch.train --config=configs/small.py:s3 --workdir=/tmp/s3_50 \
    --config.train.steps=50 --config.train.log_every=5 --config.train.eval_every=0
cp /tmp/s3_50/metrics.jsonl /tmp/s3_50/train.log $OUT/ 2>/dev/null
step ns_spec; timeout -s TERM 90 python3 -u benchmarks/optim_update.py --roots . --programs newton_schulz --json $OUT/ns_spec.json
step ns_polar; timeout -s TERM 130 python3 -u benchmarks/optim_update.py --roots . --programs update_donated newton_schulz --set optim.ns_schedule=polar_express --json $OUT/ns_polar.json
step done
