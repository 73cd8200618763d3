# Session of 2026-12-02 (c), call 2 (~480 s; carry .whl): what layer remat keeps (model.remat_saves), s3 with
# 8 micro-batches of 4 x 4096: the fixed set, + the experts' gate|up product, + the dense projections (one
# process, the state reused); then remat off at 16 micro-batches of 2 x 4096 (off does not fit at 4 rows:
# XLA's 128 GiB program in call 1).
source benchmarks/gpu_runs/calls/prelude.sh
step saves_s3; timeout -s TERM 330 python3 -u benchmarks/gpu_step.py --sizes s3 s3/saves=experts s3/saves=projections+experts --batch 4 --seq 4096 --grad_accum 8 --steps 2 --no_split --json $OUT/saves_s3.json
step noremat_s3_b2; timeout -s TERM $((500 - SECONDS)) python3 -u benchmarks/gpu_step.py --sizes s3/noremat --batch 2 --seq 4096 --grad_accum 16 --steps 2 --no_split --json $OUT/noremat_s3_b2.json
step done
