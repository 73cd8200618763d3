# Next session, call 1 (~400 s; carry .whl). Command buffers on vs off in one call (the profiler's 551.8 ms
# against gpu_step's 613.4 ms of 2026-12-01, late); the three top-k selections and the indexer kernel
# with each (pallas_kernels/topk_triton.py is untimed: if it wins, the indexer kernel's default
# select becomes "triton").
source benchmarks/gpu_runs/calls/prelude.sh
G="benchmarks/gpu_step.py --sizes s3 --batch 4 --seq 4096 --steps 5 --no_split"
step s3_cmdbuf_on; timeout -s TERM 120 python3 -u $G --json $OUT/s3_cmdbuf_on.json
step s3_cmdbuf_off; XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -s TERM 160 python3 -u $G --json $OUT/s3_cmdbuf_off.json
step topk; timeout -s TERM 120 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 100 --cases topk-4k,idx-4k
step done
