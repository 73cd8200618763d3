# Session 73 (~150 s, any Hopper card): the Engram tables' Sinkhorn direction with its statistics'
# squares stored in bfloat16 (optim.sinkhorn_stat_dtype) beside float32 (main), m3 then s3: m3's
# Sinkhorn took 65.5 ms of a 2,834-ms step at session 46 (s3: 25.6 ms on an H100, s54). If bfloat16
# is faster, the next call times it in the accumulated step (arms s3 ... main sk@/tmp/tree_sk).
#   run(command="bash benchmarks/gpu_runs/calls/next_s73_sk.sh", carry=[".whl"], timeout_s=300)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_copy sk optim/config.py 's|sinkhorn_stat_dtype: str = "float32"|sinkhorn_stat_dtype: str = "bfloat16"|' || exit 1
for size in m3 s3; do
  step "Sinkhorn direction, $size: float32 (main) vs bfloat16 statistics"
  timeout -s TERM 140 python3 -u benchmarks/optim_update.py --roots . /tmp/tree_sk --programs sinkhorn \
      --size "$size" --reps 7 --json "$OUT/sinkhorn_$size.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
done
step done
