# Session 65's second H200 call (after next_s62_m3mb.sh on the warm machine; needs_h200; ~590 s):
#   1. issues 26 and 27: s3 by source on the H200 (attention op + indexer <= 60 ms, mHC <= 40,
#      MoE <= 60; the H200 last profiled s3 at session 56, the H100 at session 59: 63.1 / 42.1 / 66.0);
#   2. issue 28: m3's launch.train for up to 50 steps at ROWS x 4096 micro-batches (default 8, the
#      micro-batch next_s62_m3mb.sh measures) and ACCUM of them (default 4: 131K tokens a step),
#      with whatever time is left (m3's launch.train has never run).
#   run(command="bash benchmarks/gpu_runs/calls/next_s65_h200b.sh", carry=[".whl"], timeout_s=600,
#       needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ -z "$SKIP_PROFILE" ]; then
  # the profile's own limit: 585 s into the call; here at most 260 s, so the run has the rest
  ( SECONDS=$(( 325 )); profile s3 s3_h200 )
fi
if [ "${gpu_mib:-0}" -lt 102400 ]; then echo "not an H200 (${gpu_mib} MiB): m3 not run"; step done; exit 0; fi
ROWS=${ROWS:-8}; ACCUM=${ACCUM:-4}
M3="--config=configs/small.py:m3 --config.train.eval_every=0 --config.train.checkpoint_every=1000 \
    --config.train.progress_bar=false --config.data.batch_size=$(( ROWS * ACCUM )) \
    --config.train.grad_accum_steps=$ACCUM"
step "m3 launch.train, $ACCUM x ($ROWS x 4096), up to 50 steps"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout -s INT $(( 585 - SECONDS )) \
    python3 -m launch.train $M3 --workdir=/tmp/m3_50 --config.train.steps=50 \
    --config.train.log_every=5 2>&1 | grep -v "step_time" | tail -20
grep -h "compiled in\|waited" /tmp/m3_50/train.log | tail -5
cp /tmp/m3_50/metrics.jsonl /tmp/m3_50/train.log $OUT/ 2>/dev/null
step done
