# Ran twice (session 60, s60_ablations_call{1,2}/ on an H100); a record now: its seed-1 points are done.
# The next call is next_s61_any.sh.
# Session 60: whichever card comes (carry .whl and build/ladder_prev; from the repository root).
# An H200 (> 100 GiB) runs next_s60_h200.sh (m3's accumulated step and the H200 profiles: issues
# 26-28); an H100 runs three more seed-1 ablations of issue 29 (next4.sh), which need no H200.
#   run(command="bash benchmarks/gpu_runs/calls/next_s60_any.sh", carry=[".whl", "build/ladder_prev"],
#       timeout_s=600)
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -ge 102400 ]; then
  exec bash benchmarks/gpu_runs/calls/next_s60_h200.sh
fi
ONLY='ablations/*_seed1' ABLATIONS=1 END=560 exec bash benchmarks/gpu_runs/calls/next4.sh
