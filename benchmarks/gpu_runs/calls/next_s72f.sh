# Session 72, H200 only (~560 s; after next_s72b.sh): m3 without layer remat. The H200 holds m3's
# 4 x 4096 micro-batch with ~58 GiB to spare (80.7 GiB peak); without remat the backward does not
# recompute each layer's forward (up to a quarter of the model's products). Session 38 found m3
# without remat at 2 x 4096 a 114 GiB program that ran out of memory under jax's default 75 %
# (104 GiB); here 95 % (132 GiB). 16 x (2 x 4096) without remat, then 16 x (4 x 4096) with it for
# the same 262,144 tokens a step (next_s72b.sh's k16 arm is the same; timed again on this machine).
#   run(command="bash benchmarks/gpu_runs/calls/next_s72f.sh", carry=[".whl"], timeout_s=600, kind="nvidia-h200")
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: m3 needs ~81 GiB at 4 x 4096"; exit 0
fi
( MB=2 K=16 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 accum m3 noremat_mb2k16 280 model.remat=False )
( K=16 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 accum m3 remat_mb4k16 $(( 585 - SECONDS )) )
step done
