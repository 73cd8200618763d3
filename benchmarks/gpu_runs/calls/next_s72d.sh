# Session 72 (Hopper, ~240 s): the warp-specialized weight gradient (`_tgmm_ws_kernel`, new this
# session, interpret-tested only) against the single-warpgroup one at the four expert shapes, then
# forward + backward with the row products at the plan's 2wg default and the weight gradient at
# 1wg (main) or its fastest 2wg. If 2wg wins everywhere and is bit for bit the same, make it
# `Plan.weight_grad`'s default and time the step (`arms s3 ... main wg1w@tree`).
#   run(command="bash benchmarks/gpu_runs/calls/next_s72d.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "grouped GEMM weight gradient, 1wg vs 2wg"
timeout -s TERM ${SECS:-270} python3 -u benchmarks/grouped_ws_gpu.py --products weight_grad \
    --reps 10 --out "$OUT" 2>&1 | grep -v "^ *File\|^    " | tail -40
step done
