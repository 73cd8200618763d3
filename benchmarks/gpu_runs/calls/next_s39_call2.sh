# 2026-12-02 (fourth session), call 2 (~520 s; carry .whl and build/clean): where a micro-batch's fixed
# cost goes. Call 1 timed s3's 131K-token step as 4 x (8 x 4096) 2,540.9 ms and 8 x (4 x 4096) 2,745.9 ms:
# ~51 ms more per micro-batch at equal tokens. Profiled by source, the same 8 rows as 2 x (4 x 4096)
# (accumulated) and as 1 x (8 x 4096): per-line differences are the fixed per-micro-batch cost
# (weight casts, weight-gradient writes, the accumulation's adds and any loop-carry copies).
source benchmarks/gpu_runs/calls/prelude.sh
step prof_2x4; timeout -s TERM 250 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --grad_accum 2 --seq 4096 --steps 1 --top 60 --out /tmp/prof_2x4 --json $OUT/prof_2x4.json
step prof_1x8; timeout -s TERM 250 python3 -u benchmarks/gpu_profile.py --size s3 --batch 8 --seq 4096 --steps 1 --top 60 --out /tmp/prof_1x8 --json $OUT/prof_1x8.json
step done
