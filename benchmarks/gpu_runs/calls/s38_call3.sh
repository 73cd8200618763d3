# Session of 2026-12-02 (c), call 3 (~470 s; carry .whl): s3's step by source at 4 and at 2 rows of 4096
# (remat on, no accumulation). Call 2 found 16 micro-batches of 2 rows (remat off) 45 % slower than 8 of 4
# (remat on): if the layers' cost were per token, the micro-batch would have a fixed cost of ~158 ms.
# The rows whose time does not halve with the rows are that cost.
source benchmarks/gpu_runs/calls/prelude.sh
step prof_s3_b4; timeout -s TERM 235 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 1 --top 40 --out /tmp/prof_b4 --json $OUT/prof_s3_b4.json
step prof_s3_b2; timeout -s TERM $((465 - SECONDS)) python3 -u benchmarks/gpu_profile.py --size s3 --batch 2 --seq 4096 --steps 1 --top 40 --out /tmp/prof_b2 --json $OUT/prof_s3_b2.json
step done
