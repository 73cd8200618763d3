# 2026-12-02 (fourth session), call 3 (~300 s; carry .whl and build/clean): s3 as 2 x (4 x 4096)
# accumulated, profiled with kernel counts per line and the top instructions' HLO text, so the
# per-micro-batch fixed cost of call 2 (49 ms: the accumulation's fusions at launch/step.py:124/128,
# the MoE's dispatch fusions, ~11,000 more kernels) can be read instruction by instruction.
source benchmarks/gpu_runs/calls/prelude.sh
step prof_2x4; timeout -s TERM 270 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --grad_accum 2 --seq 4096 --steps 1 --top 80 --out /tmp/prof_2x4 --json $OUT/prof_2x4.json
gzip -c /tmp/prof_2x4/s3.hlo.txt > $OUT/s3_2x4.hlo.txt.gz; ls -la $OUT
step done
