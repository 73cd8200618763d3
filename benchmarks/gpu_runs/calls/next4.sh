# Next sessions, calls 4+ (issue 29): the :gpu ladder grid (9 points), then its learning-rate sweep (stage 1:
# 2 sizes x 2 chains x 5 rates x 400 steps; stage 2: each best rate at seed 1), 4 points at a time. The same
# command every call, until the grid and both sweep stages are done:
#   run(command="bash benchmarks/gpu_runs/calls/next4.sh", carry=[".whl"], timeout_s=600)
# On a fresh machine (status: warm false), first unpack the last call's $OUT/ladder_gpu.tar.gz into
# build/ladder_prev here and add "build/ladder_prev" to carry: its done points are copied in and skipped.
# Never carry build/ladder_gpu itself: on a warm machine that would replace the workdir and its checkpoints.
#
# Why --jobs=4. Each point is launch- and compile-bound (0.5-1.4 % MFU): ~25 s start-up and ~30 s compilation
# on the host's cores, then steps. 16 cores: each run compiles on a few threads (XLA's passes, its
# autotuning, the data pipeline in-process), so 4 compile at once without starving one another. Memory: the
# analytic plan of the largest point (L16d512) is 16.6 GiB, each of 4 runs may take 0.225 x 139 = 31 GiB
# (the ladder checks this and exits 2 when it does not fit; up to 7 would by the plan). More than 4 buys
# little: without MPS the runs' kernels share the GPU by time-slicing, and a profile of s1 found the GPU busy
# 95 % of a step (RESULTS.md), so overlap mostly hides start-up, compilation, evaluation and saving, which
# 4 runs already cover. Order: the most compute first (L16d512_800 starts first, so it is not left alone
# at the end); a call's end interrupts the running points, which save and resume in the next call.
#
# Calls, estimated from the measured H200 times (RESULTS.md, "GPU ladder, first column": 46-75 s of
# overhead a point, steps of 0.19 / 0.355 / 0.55 s): one at a time the grid is ~2,040 s and the sweep
# ~4,100-4,500 s (stage 1 ~3,400-3,800 s, stage 2 ~700 s). With 4 at once the floor is the GPU time of
# the steps if the small points also keep it busy (grid ~1,540 s, sweep ~2,640 s), up to ~4x less if
# they leave it idle between kernels. Each call gives the ladder ~450 s and loses ~30-40 s for the
# points it restarts (start-up; compilation comes from the persistent cache on a warm machine). So the
# grid needs 2-4 calls and the sweep 3-7: 5-10 calls in all, 2-4 sessions of 30 device minutes.
# The first call's point.json "seconds" (with "jobs": 4) against the estimates above tell which end.
#
# Time: the ladder steps end by 480 s after the start (SIGINT, 30 s more before SIGKILL), the report
# and the archive by ~560 s. $OUT (at most 8 files come back): log.txt, report.md, ladder_gpu.tar.gz
# (point.json, metrics.jsonl and train.log of every point, and the report's files; no checkpoints).
# Locally: tar -xzf .../ladder_gpu.tar.gz -C DIR && python -m launch.ladder --report DIR --out=benchmarks/ladder/gpu
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
W=build/ladder_gpu
mkdir -p $W
if [ -d build/ladder_prev ]; then
  step restore; python3 - build/ladder_prev $W <<'EOF'
import json, os, shutil, sys
src, dst = sys.argv[1:]
for root, _, files in os.walk(src):
  if "point.json" not in files:
    continue
  with open(os.path.join(root, "point.json")) as f:
    done = json.load(f).get("status") == "done"
  out = os.path.join(dst, os.path.relpath(root, src))
  if done and not os.path.exists(os.path.join(out, "point.json")):
    os.makedirs(out, exist_ok=True)
    for name in files:
      shutil.copy2(os.path.join(root, name), out)
    print("restored", os.path.relpath(root, src))
EOF
fi
END=480
step grid; timeout -s INT -k 30 $((END - SECONDS)) python3 -m launch.ladder --config=configs/ladder.py:gpu --workdir=$W --jobs=4
if [ $((END - SECONDS)) -gt 120 ]; then
  step sweep; timeout -s INT -k 30 $((END - SECONDS)) python3 -m launch.ladder --config=configs/ladder.py:gpu --workdir=$W --jobs=4 --sweep
fi
step report; timeout 45 python3 -m launch.ladder --report $W > $OUT/report.md
step archive; (cd $W && find . -maxdepth 3 -type f \( -name point.json -o -name metrics.jsonl -o -name train.log \
    -o -name 'ladder.*' -o -name report.md -o -name '*.png' \) -print0 | tar --null -czf "$OUT/ladder_gpu.tar.gz" -T -)
ls -l $OUT
step done
