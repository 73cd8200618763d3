# s3 with and without 8-step accumulation (optimizer split, Sinkhorn, NS precision), m3, s1 loss A/B.
source benchmarks/gpu_runs/calls/prelude.sh
step s3_accum; timeout -s TERM 250 python3 -u benchmarks/gpu_step.py --sizes s3 s3 --batch 4 4 --grad_accum 1 8 --seq 4096 --steps 3 --sinkhorn --muon_precision --json $OUT/s3_accum.json
step m3; timeout -s TERM 170 python3 -u benchmarks/gpu_step.py --sizes m3 --batch 4 --grad_accum 8 --seq 4096 --steps 2 --no_split --json $OUT/m3.json
K="model.ops.sparse_attention=kernel model.ops.indexer_topk=kernel model.ops.hc_site=kernel model.ops.hc_coefficients=kernel"
R="model.ops.sparse_attention=reference model.ops.indexer_topk=reference model.ops.hc_site=reference model.ops.hc_coefficients=reference"
step s1_kernel; timeout -s TERM 75 python3 -u benchmarks/gpu_step.py --sizes s1 --batch 8 --seq 1024 --steps 20 --no_split --json $OUT/s1_kernel.json --set $K
step s1_reference; timeout -s TERM 75 python3 -u benchmarks/gpu_step.py --sizes s1 --batch 8 --seq 1024 --steps 20 --no_split --json $OUT/s1_reference.json --set $R
step loss_ab; python3 benchmarks/loss_ab.py $OUT/s1_kernel.json $OUT/s1_reference.json --tolerance 0.03
step done
# (250 s was too short for both s3 rows and 75 s for each s1 run: call4.sh reran them.)
