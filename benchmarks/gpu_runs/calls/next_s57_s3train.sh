# Issue 28's launch.train figure at s3 with session 56's defaults (cast_weights_once and
# unfilled_buffers on from s3 up): 50 steps of 8 x (4 x 4096), falling loss, the logged step time and
# MFU against gpu_step.py's 1,985.1 ms (12.0 %, one H200). ~300 s; carry .whl; either card (s3 fits
# an H100's 80 GB at 45 GiB). From the repository root:
#   run(command="bash benchmarks/gpu_runs/calls/next_s57_s3train.sh", carry=[".whl"], timeout_s=420)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
S3="--config=configs/small.py:s3 --config.data.batch_size=32 --config.data.seq_len=4096 \
    --config.model.seq_len=4096 --config.train.grad_accum_steps=8 --config.train.eval_every=0 \
    --config.train.checkpoint_every=1000 --config.train.progress_bar=false"
step s3_train50; timeout -s INT ${LIMIT:-390} python3 -m launch.train $S3 --workdir=/tmp/s3_50 \
    --config.train.steps=50 --config.train.log_every=5 2>&1 | grep -v "step_time" | tail -20
grep -h "compiled in\|waited" /tmp/s3_50/train.log | tail -5
cp /tmp/s3_50/metrics.jsonl /tmp/s3_50/train.log $OUT/ 2>/dev/null
step done
