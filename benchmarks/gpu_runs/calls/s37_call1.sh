# Session of 2026-12-02 (b), call 1 (~420 s; carry .whl): where the standalone optimizer update's time goes
# by source, and the s3 step by source with the Triton select default and the remat fix (a12d826).
source benchmarks/gpu_runs/calls/prelude.sh
step optim_profile; timeout -s TERM 200 python3 -u benchmarks/optim_update.py --roots . --programs update_donated sinkhorn --profile /tmp/oprof --json $OUT/optim_update.json
step prof_s3; timeout -s TERM 190 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 25 --out /tmp/prof_s3 --json $OUT/prof_s3.json
ls /tmp/prof_s3 /tmp/oprof
for f in /tmp/prof_s3/*.hlo.txt; do timeout 60 python3 benchmarks/hlo_traffic.py $f --unsourced --kinds copy --top 15; done
tar czf $OUT/hlo.tgz /tmp/prof_s3/*.hlo.txt /tmp/oprof 2>/dev/null; ls -la $OUT
step done
