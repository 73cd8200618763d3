# Next session, call 1 (~480 s; carry .whl and build/clean): command buffers for while loops and
# conditionals, A/B. Run from a clean worktree of main:
#   git worktree add build/clean HEAD && cp -r .whl build/clean/
#   run(command="cd build/clean && bash benchmarks/gpu_runs/calls/next_s41_call1.sh", carry=[".whl", "build/clean"])
# Why: 2026-12-03 call 2 found launch.train's dispatch returning only with the step (the layer
# scan's lax.switch / Engram lax.cond read their predicates back to the host), and the :gpu ladder's
# points are launch-bound (0.3-1.4 % MFU; 2026-12-03 call 4: 1.07 s a step for L12d384 with 4 jobs
# sharing the GPU). XLA's command buffers (CUDA graphs) take while loops and conditionals only when
# asked (WHILE, CONDITIONAL). If the ladder point's step or s3's step is faster with them, add the
# flag to launch/xla_flags.py GPU_DEFAULTS (with this measurement in RESULTS.md).
source benchmarks/gpu_runs/calls/prelude.sh
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
point() {  # $1: label, $2: XLA_FLAGS
  step "L12d384 60 steps, $1"; XLA_FLAGS="$2" timeout -s INT 120 python3 -m launch.train \
      --config=configs/ladder.py:gpu/L12d384/200 --workdir=/tmp/pt_$1 --config.train.steps=60 \
      --config.train.log_every=10 --config.train.eval_every=0 --config.train.progress_bar=false 2>&1 \
      | grep -E "compiled|step 60|step 30|Error|error" | cut -c1-260
}
point default ""
point cb "$CB"
step "s3 4x4096, default"; timeout -s TERM 130 python3 -u benchmarks/gpu_step.py --sizes s3 --batch 4 --seq 4096 --steps 3 --no_split --json $OUT/s3_default.json | tail -4
step "s3 4x4096, while+conditional command buffers"; XLA_FLAGS="$CB" timeout -s TERM $((560 - SECONDS)) python3 -u benchmarks/gpu_step.py --sizes s3 --batch 4 --seq 4096 --steps 3 --no_split --json $OUT/s3_cb.json | tail -4
step done
