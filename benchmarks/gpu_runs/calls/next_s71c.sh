# Session 71 (any card, ~585 s): the warp-specialized grouped GEMM (TileConfig.compute_wgs=2:
# a producer warpgroup, two consumers, chained pipelines) against the single-warpgroup kernel,
# (1) standalone at s3's and m3's expert shapes (benchmarks/grouped_ws_gpu.py), (2) in the
# accumulated s3 step (forward_narrow and input_grad set to 2wg 128 x 2x128, k64, 4 deep).
#   run(command="bash benchmarks/gpu_runs/calls/next_s71c.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "grouped GEMM row kernels: 1wg vs 2wg"
timeout -s TERM 170 python3 -u benchmarks/grouped_ws_gpu.py --reps 10 --out "$OUT"
# The step arms only when the 2wg products compiled, matched and were faster at s3's shapes;
# otherwise m3 by source at one 1 x 4096 micro-batch (never profiled since session 46).
if ! python3 - "$OUT/grouped_ws_gpu.json" <<'PY'
import json, sys
rows = {r["case"]: r for r in json.load(open(sys.argv[1]))["results"]}
ok = True
for case in ("s3 gate_up", "s3 down"):
  r = rows.get(case, {})
  for p in ("forward", "input_grad"):
    one, two = r.get(f"{p} 1wg", {}), r.get(f"{p} 2wg 128x2x128 k64 s4", {})
    good = "ms" in one and "ms" in two and two["ms"] < one["ms"] and two["rel_err"] < 4e-3
    print(case, p, "2wg used in the step arm" if good else "2wg not better", flush=True)
    ok &= good
sys.exit(0 if ok else 1)
PY
then
  ( SECONDS=$SECONDS; XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PBATCH=1 profile m3 "m3_b1" )
  step done; exit 0
fi
tree_copy ws pallas_kernels/grouped_matmul.py 's|forward_narrow: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=2)|forward_narrow: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2)|; s|input_grad: TileConfig = TileConfig(max_concurrent_steps=6, grid_block_n=2) |input_grad: TileConfig = TileConfig(max_concurrent_steps=4, compute_wgs=2) |' || exit 1
grep -n "compute_wgs=2)" /tmp/tree_ws/pallas_kernels/grouped_matmul.py
arms s3 $(( (582 - SECONDS) / 2 )) ws@/tmp/tree_ws main
step done
