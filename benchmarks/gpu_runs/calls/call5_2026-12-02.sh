# 2026-12-02, call 4 of the session (~560 s; carry .whl). Top-512 (m3, s4) against the measured
# envelopes (attention and indexer stop at top-256), the optimizer update with its state donated
# (issue 25), s3's profile with the Triton select now the indexer kernel's default, and m3's
# profile with the two CSA2 kernels forced (its top-512 is outside their envelopes).
source benchmarks/gpu_runs/calls/prelude.sh
step csa2_k512; timeout -s TERM 130 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 110 --cases topk-4k-k512,idx-4k-k512,4k-m1-k512,4k-m2-k512
step optim_donated; timeout -s TERM 120 python3 -u benchmarks/optim_update.py --roots . --programs update_donated sinkhorn --json $OUT/optim_update.json
step prof_s3; timeout -s TERM 160 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 20 --out /tmp/prof_s3 --json $OUT/prof_s3.json
step prof_m3_kernels; timeout -s TERM 170 python3 -u benchmarks/gpu_profile.py --size m3 --batch 4 --seq 4096 --steps 2 --top 20 --out /tmp/prof_m3 --json $OUT/prof_m3_kernels.json --set model.ops.sparse_attention=kernel model.ops.indexer_topk=kernel
step done
