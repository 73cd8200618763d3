# Session of 2026-12-02 (b), call 3 (~450 s; carry .whl): the new indexer kernels' GPU correctness check,
# the s3 step by source after the Sinkhorn chunks, the mHC remat names and the indexer's scores_at
# kernels; the indexer and mHC standalone.
source benchmarks/gpu_runs/calls/prelude.sh
step check; timeout -s TERM 100 python3 -u benchmarks/csa2_kernels_gpu.py --reps 3 --cases check --deadline 90
step prof_s3; timeout -s TERM 170 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 25 --out /tmp/prof_s3 --json $OUT/prof_s3.json
gzip -c /tmp/prof_s3/s3.hlo.txt > $OUT/s3.hlo.txt.gz
step idx; timeout -s TERM 130 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --cases idx-4k --deadline 120
step mhc; timeout -s TERM 100 python3 -u benchmarks/mhc_moe_gpu.py --only mhc --json=$OUT/mhc.json
step done
