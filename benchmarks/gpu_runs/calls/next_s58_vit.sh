# Issue 28's launch.train at s3: the ViT over the filled image slots only (`model.vision.slot_budget`,
# session 57, off by default until this measures it). Session 57's launch.train (s57_s3train/, H100)
# ran 2.44 s a step with the ViT frozen and 2.72 s once it trains, against gpu_step.py's ~2.30-2.37
# (no images there): every step embeds 2,048 image slots of which ~480 hold an image. Two arms of
# 40 steps one after the other (the ViT trains from step 29, the decay start), the same data and
# seed: main, then slot_budget=24 (96 places a 4-row micro-batch; ~19 % of micro-batches overflow
# to every slot: ~50 % of the ViT's slots expected). Compare the logged windows' step times per
# phase and the losses (equal up to float rounding). ~500 s; either card; carry .whl:
#   run(command="bash benchmarks/gpu_runs/calls/next_s58_vit.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
S3="--config=configs/small.py:s3 --config.data.batch_size=32 --config.data.seq_len=4096 \
    --config.model.seq_len=4096 --config.train.grad_accum_steps=8 --config.train.eval_every=0 \
    --config.train.checkpoint_every=1000 --config.train.progress_bar=false --config.train.steps=40 \
    --config.train.log_every=4"
for arm in main:0 budget24:24; do
  name=${arm%%:*}; budget=${arm#*:}
  step "s3 launch.train 40 steps, vision.slot_budget=$budget ($name)"
  timeout -s INT 270 python3 -m launch.train $S3 --workdir=/tmp/vit_$name \
      --config.model.vision.slot_budget=$budget 2>&1 | grep -E "step_time|compiled in|throughput|train loss|rror" \
      | sed -E 's/^.*INFO //' | tail -14
  mkdir -p $OUT/$name && cp /tmp/vit_$name/metrics.jsonl /tmp/vit_$name/train.log $OUT/$name/ 2>/dev/null
done
step done
# Then, on a second call if this one has no time left: the step by source with images (the ViT's
# kernels as the "vision" component), frozen and trainable:
#   PROFILE_ARGS=--images profile s3 s3_images; PROFILE_ARGS="--images --train_vit" profile s3 s3_vit
# (each ~150-200 s; `source benchmarks/gpu_runs/calls/prelude.sh` first, as every call script does).
