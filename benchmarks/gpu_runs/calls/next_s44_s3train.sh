# Next session, one call (~420 s; carry .whl and build/clean): issue 28's launch.train at s3 after
# session 43's b7ed6c7 (the ViT phases' programs compiled one after another, the first awaited
# alone; the ViT-trainable one compiles while the frozen phase trains) and c48fc2a (the memory
# check after compiling). Compare with RESULTS "launch.train at s3" (2026-12-03, call 2: both
# programs compiled concurrently in 107.1 s before the first step; steps 2.89-3.12 s).
#   run(command="cd build/clean && bash benchmarks/gpu_runs/calls/next_s44_s3train.sh",
#       carry=[".whl", "build/clean"], timeout_s=600)
# Expected: "train step compiled in" ~55 s (one program; the issue asks <= 90 s), no "waited ... for
# the ViT-trainable train step" line if the second program is ready by the unfreezing step, steps
# as before (slower while the second program compiles beside them). Then the memory check: one
# 32 x 4096 micro-batch (grad_accum_steps=1) must stop after its compile with one error line naming
# the program's size (the analytic plan says ~280 GiB) and a grad_accum_steps that fits (exit 2).
source benchmarks/gpu_runs/calls/prelude.sh
S3="--config=configs/small.py:s3 --config.data.batch_size=32 --config.data.seq_len=4096 \
    --config.model.seq_len=4096 --config.train.eval_every=0 --config.train.checkpoint_every=1000 \
    --config.train.progress_bar=false"
step s3_train; timeout -s INT 270 python3 -m launch.train $S3 --workdir=/tmp/s3_t \
    --config.train.grad_accum_steps=8 --config.train.steps=30 --config.train.log_every=2 \
    2>&1 | grep -v "step_time" | tail -25
grep -h "step_time\|waited\|compiled in" /tmp/s3_t/train.log | tail -20
cp /tmp/s3_t/metrics.jsonl $OUT/ 2>/dev/null; cp /tmp/s3_t/train.log $OUT/ 2>/dev/null
step s3_too_big; timeout -s INT 120 python3 -m launch.train $S3 --workdir=/tmp/s3_big \
    --config.train.grad_accum_steps=1 --config.train.steps=2 2>&1 | tail -3; echo "exit ${PIPESTATUS[0]}"
ls /tmp/s3_big 2>&1 | head -3
step done
