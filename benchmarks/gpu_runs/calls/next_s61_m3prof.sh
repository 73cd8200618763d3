# Issue 28's profile table for the 3B-class config on an H200 (last taken at session 46: MoE 102.1 ms
# a micro-batch, dense 64.9, attention 61.6, the optimizer 299.7 once a step). next_s60_h200.sh
# reaches m3's profile only if its first two steps leave time (they likely do not: m3's accumulated
# step ~240 s, s3's profile ~200 s), so this call takes it alone, right after that one on the same warm
# machine (~300 s: init, compile ~90 s, two profiled steps, the trace's parse). An H200 only.
#   run(command="bash benchmarks/gpu_runs/calls/next_s61_m3prof.sh", carry=[".whl"], timeout_s=600,
#       needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -lt 102400 ]; then
  echo "m3 at 4 x 4096 needs ~71-81 GiB beside the profiler; this card has ${gpu_mib} MiB: not run"; exit 0
fi
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 profile m3 m3_h200
step done
