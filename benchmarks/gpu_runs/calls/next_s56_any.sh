# Session 56, whichever card comes (carry .whl; from the repository root):
#   run(command="bash benchmarks/gpu_runs/calls/next_s56_any.sh", carry=[".whl"], timeout_s=600)
# Issue 28: s3's accumulated step (8 x (4 x 4096)) on main, with `model.cast_weights_once` (the
# routed experts' w1/w3 handed over as one pair), and with `train.unfilled_buffers` (scan stacks and
# the kind switch's residual slots as XLA AllocateBuffer instead of zero fills: ~12 GB of fills a
# micro-batch at s3 by the CUDA lowering read on the CPU). An H200 pairs two arms (compiled at once,
# timed in turn); an H100 runs them one after another. (Ran in session 56 on an H200: RESULTS.md
# "s3 at 12.0 % MFU"; the arms' second losses differ as two runs of one program do on the GPU.)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
END=${END:-585}   # a call shorter than 600 s: END = its timeout less 15
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -ge 102400 ]; then
  arms s3 $(( (END - SECONDS) / 2 )) main cast:model.cast_weights_once=true
  arms s3 $(( END - SECONDS )) unfilled:train.unfilled_buffers=true \
      cast_unfilled:model.cast_weights_once=true,train.unfilled_buffers=true
else
  accum s3 unfilled $(( (END - SECONDS) / 3 )) train.unfilled_buffers=true
  accum s3 main $(( (END - SECONDS) / 2 ))
  accum s3 cast_unfilled $(( END - SECONDS )) model.cast_weights_once=true train.unfilled_buffers=true
fi
step done
