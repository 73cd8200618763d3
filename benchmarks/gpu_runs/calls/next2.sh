# Next session, call 2 (~520 s; carry .whl): m3's profile table (issue 28), s3 by launch.train for 50 steps
# (131K tokens a step: 8 micro-batches of 8 x 2048, the config's own batch), the attention's m2 ratios.
source benchmarks/gpu_runs/calls/prelude.sh
step prof_m3; timeout -s TERM 200 python3 -u benchmarks/gpu_profile.py --size m3 --batch 4 --seq 4096 --steps 2 --top 20 --out /tmp/prof --json $OUT/prof_m3.json
step s3_train50; timeout -s INT 230 python3 -m launch.train --config=configs/small.py:s3 --workdir=/tmp/s3_50 \
    --config.train.steps=50 --config.train.log_every=5 --config.train.eval_every=0; cp /tmp/s3_50/metrics.jsonl $OUT/s3_train50.jsonl
step csa2_m2; timeout -s TERM 100 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 80 --cases 4k-m2,32k-m2,4k-m1-stages
step done
