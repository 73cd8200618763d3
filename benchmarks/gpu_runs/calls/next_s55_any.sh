# Session 55, whichever card comes (carry .whl, build/ladder_prev, build/xla_cache; from the root):
#   run(command="bash benchmarks/gpu_runs/calls/next_s55_any.sh", carry=[...], timeout_s=600)
# An H200 (>= 100 GiB): next_s55_call1.sh (s3 and m3 main, issue 28). An H100: issue 29's ablations
# at seed 0 (next4.sh), which an H100 serves as well.
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "card memory: ${gpu_mib} MiB"
if [ "${gpu_mib:-0}" -ge 102400 ]; then
  exec bash benchmarks/gpu_runs/calls/next_s55_call1.sh
fi
ONLY='ablations/*_seed0' ABLATIONS=1 exec bash benchmarks/gpu_runs/calls/next4.sh
