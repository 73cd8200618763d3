# Session 63's second H200 call (~560 s; after next_s63_h200.sh on the warm machine; needs_h200):
#   1. issue 28: m3 at 8 x (4 x 4096) (its configured micro-batch; 15.5 % MFU at session 47), the
#      baseline beside the first call's 4 x (8 x 4096);
#   2. issue 28: m3's launch.train, 50 steps at the configured 8 x (4 x 4096) (never run), with
#      whatever time is left (LIMIT seconds, default to the call's end).
#   run(command="bash benchmarks/gpu_runs/calls/next_s63_h200b.sh", carry=[".whl"], timeout_s=600,
#       needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then echo "not an H200 (${gpu_mib} MiB): m3 not run"; exit 0; fi
[ -z "$SKIP_ACCUM" ] && accum m3 main 250
M3="--config=configs/small.py:m3 --config.train.eval_every=0 --config.train.checkpoint_every=1000 \
    --config.train.progress_bar=false"
step m3_train50; XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout -s INT ${LIMIT:-$(( 585 - SECONDS ))} \
    python3 -m launch.train $M3 --workdir=/tmp/m3_50 --config.train.steps=50 \
    --config.train.log_every=5 2>&1 | grep -v "step_time" | tail -20
grep -h "compiled in\|waited" /tmp/m3_50/train.log | tail -5
cp /tmp/m3_50/metrics.jsonl /tmp/m3_50/train.log $OUT/ 2>/dev/null
step done
