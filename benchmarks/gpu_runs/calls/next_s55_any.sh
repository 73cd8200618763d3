# Session 55, whichever card comes (carry .whl, build/ladder_prev, build/xla_cache; from the root):
#   run(command="bash benchmarks/gpu_runs/calls/next_s55_any.sh", carry=[...], timeout_s=600)
# An H200 (>= 100 GiB, issue 28): s3's accumulated step on main (expected ~2,040 ms, ~11.7 %; 12 %
# is ~1,996 ms), then s3's component table with the profile's corrected rules (block.py's mHC,
# attention and indexer calls by function: session 55), which decides issues 26 (attention +
# indexer <= 60 ms) and 27 (mHC <= 40, MoE <= 60) on the H200. m3 follows in a second call
# (next_s55_call1.sh's m3 row, next_s55_call2.sh). An H100: issue 29's ablations at seed 0.
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "card memory: ${gpu_mib} MiB"
if [ "${gpu_mib:-0}" -ge 102400 ]; then
  source benchmarks/gpu_runs/calls/prelude.sh
  OUT=$(realpath "$OUT")
  accum s3 main 260
  profile s3 s3_h200
  step done
  exit 0
fi
ONLY='ablations/*_seed0' ABLATIONS=1 exec bash benchmarks/gpu_runs/calls/next4.sh
