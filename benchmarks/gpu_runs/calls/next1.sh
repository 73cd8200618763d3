# Next session, call 1 (~580 s; carry .whl). Where the standalone optimizer update's 173 ms go against
# the 120.7 ms of optimizer kernels inside the step (issue 25: <= 150 ms, Sinkhorn <= 30 ms asked); s3's
# and m3's step by source with the Triton select the indexer kernel's default and (m3) the top-512
# envelopes of 86f48a5 (issues 26-28; RESULTS "Command buffers, the Triton select, top-512, ...").
source benchmarks/gpu_runs/calls/prelude.sh
step optim_profile; timeout -s TERM 200 python3 -u benchmarks/optim_update.py --roots . --programs update_donated sinkhorn --profile /tmp/oprof --json $OUT/optim_update.json
step prof_s3; timeout -s TERM 190 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 20 --out /tmp/prof_s3 --json $OUT/prof_s3.json
step prof_m3; timeout -s TERM 190 python3 -u benchmarks/gpu_profile.py --size m3 --batch 4 --seq 4096 --steps 2 --top 30 --out /tmp/prof_m3 --json $OUT/prof_m3.json
# Newton-Schulz loop-carry copies (c28fbaf: 2 before, 0 expected) and what is left without a source
# (RESULTS, "What the no-source kernels are"; the Sinkhorn pads should be gone since 60112e6).
grep -cE '^ +%copy[.0-9]* = bf16\[(1560,1536,768|780,768,1536)\]' /tmp/prof_m3/m3.hlo.txt
timeout 60 python3 benchmarks/hlo_traffic.py /tmp/prof_m3/m3.hlo.txt --unsourced --kinds copy --top 15
step done
