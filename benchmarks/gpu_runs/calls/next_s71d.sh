# Session 71, first call of either card: an H200 runs next_s66_h200a.sh (s3 by source, then m3 at
# 4 x (8 x 4096): the figures issues 26-28 name), an H100 next_s71c.sh (the warp-specialized
# grouped GEMM standalone and in the accumulated s3 step).
#   run(command="bash benchmarks/gpu_runs/calls/next_s71d.sh", carry=[".whl"], timeout_s=600)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash benchmarks/gpu_runs/calls/next_s66_h200a.sh
fi
exec bash benchmarks/gpu_runs/calls/next_s71c.sh
