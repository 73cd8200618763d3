# Session of 2026-12-02 (c), call 3 (~300 s; carry .whl): the micro-batch size at a fixed 131K-token step
# (remat on, the state reused): s3 as 4 x (8 x 4096), 8 x (4 x 4096), 16 x (2 x 4096). Call 2 found
# 16 x 2 rows (remat off) 45 % slower than 8 x 4 rows (remat on): if the layers' cost were per token, a
# micro-batch would carry a fixed ~158 ms, and fewer, larger micro-batches would pay it less often.
source benchmarks/gpu_runs/calls/prelude.sh
step micro_s3; timeout -s TERM 300 python3 -u benchmarks/gpu_step.py --sizes s3 s3 s3 --batch 8 4 2 --grad_accum 4 8 16 --seq 4096 --steps 2 --no_split --json $OUT/micro_s3.json
step done
