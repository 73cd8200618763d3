# Next session, second call (issue 28's m3, H200 only: ~560 s; carry .whl; from the repository root).
# Issue 28 leaves m3's micro-batch free ("at its micro-batch with accumulation"); s3's is fixed at 4 x 4096.
# Same global batch (131,072 tokens), larger micro-batches: the grouped GEMMs get 2-4x the rows per
# expert, and each micro-batch's fixed costs (its gradient accumulation pass over 17 GB of float32
# gradients, ~10 ms on the H200; ~6,000 kernels under 10 us) come 4 or 2 times a step instead of 8.
# The analytic plan (`python -m launch.aot --config=configs/small.py:m3 --mesh=data:1 --batch=32
# --seq=4096 --analytic --backend=gpu --config.train.grad_accum_steps=K`): 80.2 GiB at K=8 (measured
# 80.7), 88.3 at K=4; K=2 ~104 (estimate). If one wins beyond noise, m3's config takes it
# (configs/small.py SIZES, its docstring's memory plan) and RESULTS records it beside call 1's row.
#   run(command="bash benchmarks/gpu_runs/calls/next_s55_call2.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
MB=8 K=4 accum m3 mb8 270
MB=16 K=2 accum m3 mb16 $(( 585 - SECONDS ))
step done
