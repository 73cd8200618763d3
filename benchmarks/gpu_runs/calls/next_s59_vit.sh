# Issue 28's launch.train at s3: the ViT over the filled image slots only (`model.vision.slot_budget`,
# session 57, off by default until this measures it). Session 57's launch.train (s57_s3train/, H100)
# ran 2.44 s a step with the ViT frozen and 2.72 s once it trains, against gpu_step.py's ~2.26-2.33
# (no images there): every step embeds 2,048 image slots of which ~480 hold an image.
# ONE ARM A CALL: session 58 ran both arms in one call under 270 s each and lost the second: the
# first compile took 141 s (81.7 s at session 57; that call's host was slower throughout: the
# parameters' init 51.0 s against 30.9), so an arm is up to ~350 s (start-up ~50 s, compile ~140 s, 40 steps of ~2.5 s, the
# ViT-trainable program compiling beside the first phase). Run it twice, back to back:
#   run(command="ARM=budget24 bash benchmarks/gpu_runs/calls/next_s59_vit.sh", carry=[".whl"], timeout_s=480)
#   run(command="ARM=main bash benchmarks/gpu_runs/calls/next_s59_vit.sh", carry=[".whl"], timeout_s=480)
# (main again because session 58 changed the step: RoPE and hc_site's X', ~3 % shorter.) The ViT
# trains from step 29 (the decay start). Compare the logged windows' step times per phase and the
# losses (equal up to float rounding; a budget of 24 a row, 96 places a micro-batch: ~19 % of
# micro-batches overflow to every slot, ~50 % of the ViT's slots expected).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
S3="--config=configs/small.py:s3 --config.data.batch_size=32 --config.data.seq_len=4096 \
    --config.model.seq_len=4096 --config.train.grad_accum_steps=8 --config.train.eval_every=0 \
    --config.train.checkpoint_every=1000 --config.train.progress_bar=false --config.train.steps=40 \
    --config.train.log_every=4"
case "${ARM:-budget24}" in main) budget=0;; budget24) budget=24;; *) echo "ARM is main or budget24"; exit 2;; esac
name=${ARM:-budget24}
step "s3 launch.train 40 steps, vision.slot_budget=$budget ($name)"
timeout -s INT 440 python3 -m launch.train $S3 --workdir=/tmp/vit_$name \
    --config.model.vision.slot_budget=$budget 2>&1 | grep -E "step_time|compiled in|throughput|train loss|rror" \
    | sed -E 's/^.*INFO //' | tail -16
mkdir -p $OUT/$name && cp /tmp/vit_$name/metrics.jsonl /tmp/vit_$name/train.log $OUT/$name/ 2>/dev/null
step done
# Then, on a later call: the step by source with images (the ViT's kernels as the "vision"
# component), frozen and trainable:
#   PROFILE_ARGS=--images profile s3 s3_images; PROFILE_ARGS="--images --train_vit" profile s3 s3_vit
# (each ~150-200 s; `source benchmarks/gpu_runs/calls/prelude.sh` first, as every call script does).
