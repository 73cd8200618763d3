# Session of 2026-12-02 (b), call 4 (~560 s; carry .whl): after this session's attention, MoE, mHC and indexer
# changes: GPU correctness of the attention kernel with its fused global probabilities, the s3 step by source,
# s3 with 8 micro-batches (issue 25's optimizer share, issue 28's MFU), then the standalone rows.
source benchmarks/gpu_runs/calls/prelude.sh
step check; timeout -s TERM 80 python3 -u benchmarks/csa2_kernels_gpu.py --reps 3 --deadline 70 --cases check
step prof_s3; timeout -s TERM 170 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 30 --out /tmp/prof_s3 --json $OUT/prof_s3.json
gzip -c /tmp/prof_s3/s3.hlo.txt > $OUT/s3.hlo.txt.gz
step accum_s3; timeout -s TERM 130 python3 -u benchmarks/gpu_step.py --sizes s3 --batch 4 --seq 4096 --grad_accum 8 --steps 2 --no_split --json $OUT/accum_s3.json
step attn; timeout -s TERM 80 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 70 --cases 4k-m1,4k-m2,idx-4k
step moe; timeout -s TERM 70 python3 -u benchmarks/mhc_moe_gpu.py --only moe --reps 10 --budget-s 60 --json=$OUT/moe.json
step mhc; timeout -s TERM 50 python3 -u benchmarks/mhc_moe_gpu.py --only mhc --reps 10 --budget-s 40 --json=$OUT/mhc.json
step done
