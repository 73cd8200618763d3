# Issue 28's launch.train figure for the 3B-class config (never run): m3 for 50 steps of its default
# 32 x 4096 rows as 8 micro-batches of 4 x 4096, the real pipeline and the defaults, falling loss, the
# logged step time and MFU beside gpu_step.py's (next_s60_h200.sh). An H200 only: m3's micro-batch
# takes ~81 GiB (pass needs_h200). ~330 s: init ~40 s, compile ~60-90 s, 50 steps of ~2.5-2.8 s.
# From the repository root:
#   run(command="bash benchmarks/gpu_runs/calls/next_s61_m3train.sh", carry=[".whl"], timeout_s=480,
#       needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then
  echo "m3 at 4 x 4096 a micro-batch needs ~81 GiB; this card has ${gpu_mib} MiB: not run"; exit 0
fi
M3="--config=configs/small.py:m3 --config.train.eval_every=0 --config.train.checkpoint_every=1000 \
    --config.train.progress_bar=false"
step m3_train50; XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout -s INT ${LIMIT:-420} python3 -m launch.train \
    $M3 --workdir=/tmp/m3_50 --config.train.steps=50 --config.train.log_every=5 2>&1 \
    | grep -v "step_time" | tail -20
grep -h "compiled in\|waited" /tmp/m3_50/train.log | tail -5
cp /tmp/m3_50/metrics.jsonl /tmp/m3_50/train.log $OUT/ 2>/dev/null
step done
