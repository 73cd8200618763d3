# Next session, call 2 (~500 s; carry .whl and build/optim_base, made first with
#   mkdir -p build/optim_base && git archive 9693e88 optim launch configs dsv41_jax pallas_kernels data | tar -x -C build/optim_base).
# m3's profile table (issue 28), the optimizer before / after (issue 25), the attention's m2 ratios (issue 26).
source benchmarks/gpu_runs/calls/prelude.sh
step prof_m3; timeout -s TERM 200 python3 -u benchmarks/gpu_profile.py --size m3 --batch 4 --seq 4096 --steps 2 --top 20 --out /tmp/prof --json $OUT/prof_m3.json
for f in $(find /tmp/prof -name '*.hlo.txt'); do gzip -c "$f" > $OUT/$(basename "$f").gz; done   # for the copies with no source line
step optim_update; timeout -s TERM 190 python3 -u benchmarks/optim_update.py --roots build/optim_base . --json $OUT/optim_update.json
step csa2_m2; timeout -s TERM 100 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 80 --cases 4k-m2,32k-m2,4k-m1-stages
step done
