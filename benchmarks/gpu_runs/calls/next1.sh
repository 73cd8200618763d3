# Next session, call 1 (~480 s; carry .whl and build/optim_base, made first with
#   mkdir -p build/optim_base && git archive 9693e88 optim launch configs dsv41_jax pallas_kernels data | tar -x -C build/optim_base).
# Command buffers on vs off in one call (the profiler's 551.8 ms vs gpu_step's 613.4 ms of 2026-12-01, late);
# the optimizer before / after; the attention kernel's other ratios and backward stages.
source benchmarks/gpu_runs/calls/prelude.sh
G="benchmarks/gpu_step.py --sizes s3 --batch 4 --seq 4096 --steps 5 --no_split"
step s3_cmdbuf_on; timeout -s TERM 120 python3 -u $G --json $OUT/s3_cmdbuf_on.json
step s3_cmdbuf_off; XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -s TERM 160 python3 -u $G --json $OUT/s3_cmdbuf_off.json
step optim_update; timeout -s TERM 200 python3 -u benchmarks/optim_update.py --roots build/optim_base . --json $OUT/optim_update.json
step done
