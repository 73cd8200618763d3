# Session 74's first call (any Hopper card, ~590 s): the layer boundary's single-pass site
# (model.single_pass_boundary=true: each MoE output written by the next layer's attention site through
# the rows mHC kernel) beside main in the accumulated s3 step. Session 73 measured the rows kernel at
# the MoE site 183 ms a step faster than the same site as XLA (2,158.3 vs 2,341.6 ms, H100); the
# boundary site is still XLA on main. On an H200 the arms compile at once (~330 s) and the rest of the
# call profiles s3 with the switch (issue 27's mHC row, issue 26's attention + indexer on the H200);
# on an H100 the two arms run one after the other (~2 x 250 s). If faster: make it the default
# (configs/small.py or ModelConfig) and time m3 with it (next_s73.sh's m3 branch with --set).
#   run(command="bash benchmarks/gpu_runs/calls/next_s74.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then
  arms s3 $(( (575 - SECONDS) / 2 )) spb:model.single_pass_boundary=true main
else
  arms s3 330 spb:model.single_pass_boundary=true main
  profile s3 s3_spb_h200 model.single_pass_boundary=true
fi
step done
