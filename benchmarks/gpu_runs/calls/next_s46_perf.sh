# Next session (issues 27 / 28, ~520 s; carry .whl; from the repository root): s3's accumulated step
# with float32 streams, bfloat16 streams, and bfloat16 streams with the weights cast once per step
# (session 45: `model.cast_weights_once`, launch/step.py CAST_ONCE; bit for bit the same step on the
# CPU, unmeasured on the GPU), side by side in one call.
#   run(command="bash benchmarks/gpu_runs/calls/next_s46_perf.sh", carry=[".whl"], timeout_s=600)
# Expected: base ~2.68 s, bf16 2.28 s (session 45: 2,284.2 ms, 10.5 %), bf16 + cast once a few tens
# of ms less (each micro-batch's forward and remat forward cast ~1 B float32 weights, ~3 ms a pass
# at 4.3 TB/s, and the weight gradients' layer stacks are written in bfloat16). If it is faster,
# make cast_weights_once the default (ModelConfig) and take the profile (next_s45_perf.sh's last
# step with both --set items).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
s3_accum base 165
s3_accum bf16 165 model.hc_stream_dtype=bfloat16
s3_accum bf16_cast 165 model.hc_stream_dtype=bfloat16 model.cast_weights_once=true
step done
