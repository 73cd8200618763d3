# Issue 25 optimizer before/after, issue 26 standalone kernels, issue 27 standalone mHC / MoE.
source benchmarks/gpu_runs/calls/prelude.sh
step optim_update; timeout -s TERM 200 python3 -u benchmarks/optim_update.py --roots build/optim_base . --json $OUT/optim_update.json
step csa2; timeout -s TERM 165 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 120 --cases check,4k-m1,topk-4k,idx-4k,32k-m1
step mhc_moe; timeout -s TERM 150 python3 -u benchmarks/mhc_moe_gpu.py --json=$OUT/mhc_moe.json --budget-s=115 --reps=20
step done
