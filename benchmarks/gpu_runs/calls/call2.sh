# The s3 step by source: default policy, the Triton indexer kernel, mHC on its references.
source benchmarks/gpu_runs/calls/prelude.sh
P="benchmarks/gpu_profile.py --size s3 --batch 4 --seq 4096 --steps 2 --top 20 --out /tmp/prof"
step prof_auto; timeout -s TERM 180 python3 -u $P --json $OUT/prof_auto.json
step prof_idx; timeout -s TERM 175 python3 -u $P --json $OUT/prof_idx.json --set model.ops.indexer_topk=kernel
step prof_hcref; timeout -s TERM 175 python3 -u $P --json $OUT/prof_hcref.json --set model.ops.hc_site=reference model.ops.hc_coefficients=reference
step done
