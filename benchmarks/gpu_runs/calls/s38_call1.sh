# Session of 2026-12-02 (c), call 1 (~560 s; carry .whl): the s3 step by source after the fused_mix revert
# (issue 27/28), then layer remat off against on with accumulation (issue 28: the biggest untested lever;
# s3's peak was 36 GiB of 139 with remat), for s3 and m3.
source benchmarks/gpu_runs/calls/prelude.sh
step prof_s3; timeout -s TERM 165 python3 -u benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 30 --out /tmp/prof_s3 --json $OUT/prof_s3.json
step s3_noremat_b4; timeout -s TERM 100 python3 -u benchmarks/gpu_step.py --sizes s3/noremat --batch 4 --seq 4096 --grad_accum 8 --steps 2 --no_split --json $OUT/s3_noremat_b4.json \
  || { step s3_noremat_b2; timeout -s TERM 100 python3 -u benchmarks/gpu_step.py --sizes s3/noremat --batch 2 --seq 4096 --grad_accum 16 --steps 2 --no_split --json $OUT/s3_noremat_b2.json; }
step m3_noremat_b2; timeout -s TERM 130 python3 -u benchmarks/gpu_step.py --sizes m3/noremat --batch 2 --seq 4096 --grad_accum 16 --steps 2 --no_split --json $OUT/m3_noremat_b2.json
step m3_b4; timeout -s TERM $((585 - SECONDS)) python3 -u benchmarks/gpu_step.py --sizes m3 --batch 4 --seq 4096 --grad_accum 8 --steps 2 --no_split --json $OUT/m3_b4.json
step done
