# The two runs call 3 cut by its timeouts: s3 with 8 micro-batches, the s1 20-step loss A/B.
source benchmarks/gpu_runs/calls/prelude.sh
step s3_accum8; timeout -s TERM 150 python3 -u benchmarks/gpu_step.py --sizes s3 --batch 4 --grad_accum 8 --seq 4096 --steps 2 --no_split --json $OUT/s3_accum8.json
K="model.ops.sparse_attention=kernel model.ops.indexer_topk=kernel model.ops.hc_site=kernel model.ops.hc_coefficients=kernel"
R="model.ops.sparse_attention=reference model.ops.indexer_topk=reference model.ops.hc_site=reference model.ops.hc_coefficients=reference"
step s1_kernel; timeout -s TERM 115 python3 -u benchmarks/gpu_step.py --sizes s1 --batch 8 --seq 1024 --steps 20 --no_split --json $OUT/s1_kernel.json --set $K
step s1_reference; timeout -s TERM 110 python3 -u benchmarks/gpu_step.py --sizes s1 --batch 8 --seq 1024 --steps 20 --no_split --json $OUT/s1_reference.json --set $R
step loss_ab; python3 benchmarks/loss_ab.py $OUT/s1_kernel.json $OUT/s1_reference.json --tolerance 0.03
step done
