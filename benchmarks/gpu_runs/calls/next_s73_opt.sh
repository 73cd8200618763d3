# Session 73 (~300-450 s, any Hopper card): two optimizer candidates, each beside main in one call
# (benchmarks/optim_update.py: one process per tree, same random inputs, median of 7 calls):
#   sk   the Engram tables' Sinkhorn with its statistics' squares stored in bfloat16
#        (optim.sinkhorn_stat_dtype; m3's Sinkhorn took 65.5 ms of a 2,834-ms step at session 46,
#        s3's 25.1 ms on an H100 at session 70);
#   nsp  Newton-Schulz's step polynomial P = (a+b+c)I + (b+2c)A_s + c A_s^2 with A_s^2 in float32
#        straight into the combination, so XLA can fuse the combination into the product's epilogue
#        as it does A_s = X^T X - I (the separate polynomial pass: 14.6 ms of s3's step on an H100,
#        session 70, `optim/muon.py:194`). Numerics: A_s^2 no longer rounded to bf16 before the sum.
# m3 first (the size whose step issue 28 still needs), then s3. A faster candidate goes into the step
# next (arms s3 ... main sk@/tmp/tree_sk).
#   run(command="bash benchmarks/gpu_runs/calls/next_s73_opt.sh", carry=[".whl"], timeout_s=480)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_copy sk optim/config.py 's|sinkhorn_stat_dtype: str = "float32"|sinkhorn_stat_dtype: str = "bfloat16"|' || exit 1
tree_copy nsp optim/muon.py 's|c \* square(as_MxM, bf16)|c * square(as_MxM, f32)|' || exit 1
for size in m3 s3; do
  step "Newton-Schulz, $size: main vs nsp"
  timeout -s TERM 150 python3 -u benchmarks/optim_update.py --roots . /tmp/tree_nsp --programs newton_schulz \
      --size "$size" --reps 7 --json "$OUT/ns_$size.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
  step "Sinkhorn direction, $size: main (float32) vs sk (bfloat16 statistics)"
  timeout -s TERM 100 python3 -u benchmarks/optim_update.py --roots . /tmp/tree_sk --programs sinkhorn \
      --size "$size" --reps 7 --json "$OUT/sinkhorn_$size.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
done
step done
