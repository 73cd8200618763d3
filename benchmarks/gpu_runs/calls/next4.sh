# Next sessions (issue 29): the :gpu ladder grid (9 points), then its learning-rate sweep (stage 1:
# 2 sizes x 2 chains x 5 rates x 400 steps; stage 2: each best rate at seed 1).
#
# 2026-12-03 (call 4, --jobs=4, nothing selected) taught two things. (1) A point that a call does not
# finish is lost: its checkpoints stay on the machine, which is given back after the call (and a
# fresh machine is started for the next), so 4 long points ran 470 s and none finished. (2) With 4 at
# once each point stepped 3.1x slower than alone (L16d512 1.73 s against 0.55 s, L12d384 1.07 s), and
# the 4th process ran out of memory on its first step (a 17.36 GiB allocation within its 0.225 share;
# the analytic plan, 16.6 GiB for the point, is within ~12 % of that program, so most likely the device
# itself was full: 4 x 31.3 GiB of allocator shares plus each process's memory outside them). So each call now names the points it can
# finish (ONLY, launch.ladder --only) and runs at most 2 at once. Estimates alone (2026-11-30 step
# times; ~60-75 s of start-up and compilation a point): L8d256 200/400/800 ~85/135/210 s, L12d384
# ~145/215/360 s, L16d512 ~155/280/500 s. Calls (each with the previous calls' archives restored):
#   A: ONLY=L16d512_800 JOBS=1                          (~500 s)
#   B: ONLY=L12d384_800,L16d512_200 JOBS=1              (~515 s)
#   C: ONLY=L16d512_400,L12d384_400 JOBS=1              (~495 s)
#   D: ONLY=L8d256_*,L12d384_200 JOBS=2                 (~580 s one by one; 2 at once)
#   then the sweep, SWEEP=1 with ONLY per call the same way (10 points of L8d256_400-like ~135 s, 10 of
#   L12d384_400-like ~215 s, then stage 2). If next_s41_call1.sh finds the WHILE/CONDITIONAL command
#   buffers faster, every estimate shrinks; re-estimate from the first call's point.json "seconds".
#   run(command="cd build/clean && ONLY=L16d512_800 JOBS=1 bash benchmarks/gpu_runs/calls/next4.sh",
#       carry=[".whl", "build/clean"], timeout_s=600)
# Before each call, unpack every earlier call's $OUT/ladder_gpu.tar.gz into build/clean/build/ladder_prev
# here (carried with build/clean): its done points are copied in and skipped.
# Never carry build/ladder_gpu itself: on a warm machine that would replace the workdir and its checkpoints.
#
# Time: the ladder steps end by END (default 545) s after the start (SIGINT, 30 s more before SIGKILL), the report
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
END=${END:-545}
: "${ONLY:?set ONLY to the points this call can finish (see above)}" "${JOBS:=1}"
step "ladder ${SWEEP:+sweep }$ONLY, $JOBS at once"
timeout -s INT -k 30 $((END - SECONDS)) python3 -m launch.ladder --config=configs/ladder.py:gpu --workdir=$W \
    --jobs=$JOBS --only="$ONLY" ${SWEEP:+--sweep}
step report; timeout 45 python3 -m launch.ladder --report $W > $OUT/report.md
step archive; (cd $W && find . -maxdepth 3 -type f \( -name point.json -o -name metrics.jsonl -o -name train.log \
    -o -name 'ladder.*' -o -name report.md -o -name '*.png' \) -print0 | tar --null -czf "$OUT/ladder_gpu.tar.gz" -T -)
ls -l $OUT
step done
