# Next sessions (issue 29): the :gpu ladder grid (9 points), then its learning-rate sweep (stage 1:
# 2 sizes x 2 chains x 5 rates x 400 steps; stage 2: each best rate at seed 1).
#
# A point that a call does not finish is lost: its checkpoints stay on the machine, which is given
# back after the call (2026-12-03: L16d512_400 stopped at step 366 of 400). So the ladder runs with
# --time_limit (the seconds left to END): it starts only the points that the finished points of
# their size say will end in time (launch/ladder_jobs.py estimate_seconds) and goes on to the next
# that fits. Several at once do not pay (2026-12-03 call 4: 4 jobs at 3.1x their solo step time,
# one out of memory): JOBS=1.
#
# The grid is done (2026-12-03, sessions 41-42; archives in benchmarks/gpu_runs/2026-12-03/s41_call{2,3} and
# s42_call{1,2,3}/ladder_gpu.tar.gz). Next: the sweep, each call as many points as fit:
#   run(command="cd build/clean && SWEEP=1 bash benchmarks/gpu_runs/calls/next4.sh",
#       carry=[".whl", "build/clean"], timeout_s=600)
# (ONLY defaults to '*': the time limit starts what fits, a sweep point timed by the finished points
# of its chain at its size, else by the grid's points of that size. Points of 400 steps at L8d256
# and L12d384: ~82 and ~140 s each with the travelling compilation cache.)
# Session 43 (2026-12-03): L8d256's stage 1 is done (11 points) and L12d384's 4e-3 of each chain;
# archives in benchmarks/gpu_runs/2026-12-03/s43_call{1,2,3}. Next, in this order:
#   ONLY='*L12d384_*_lr0.001_seed0,*L12d384_*_lr0.002_seed0,*L12d384_*_lr0.008_seed0' (6 points)
#   ONLY='*_seed1' (stage 2: each (size, chain)'s best at seed 1, 4 points)
# and L12d384's lowest rates only if an optimum sits at 1e-3.
# Session 44: L12d384's AdamW 1e-3, 2e-3, 8e-3 and Muon 2e-3 done (s44_call{3,4}); AdamW's optimum is
# 2e-3, Muon's best so far 4e-3 at the top of what ran. Next, in this order:
#   ONLY='*L12d384_muon_lr0.008_seed0,*L12d384_muon_lr0.001_seed0' (2 points, ~140 s each)
#   ONLY='*_seed1' (stage 2, 4 points)
# Sessions 45-47 had no device time for it. From session 46 on the checkout is fresh each session and
# there is no build/clean: run `bash benchmarks/gpu_runs/calls/sweep_prepare.sh` (it unpacks every
# archive into build/ladder_prev: 26 done points), commit, then from the repository root:
#   run(command="ONLY='*L12d384_muon_lr0.008_seed0' SWEEP=1 bash benchmarks/gpu_runs/calls/next4.sh",
#       carry=[".whl", "build/ladder_prev"], timeout_s=600)
#   then ONLY='*_seed1' (stage 2, 4 points: over two calls if they do not fit one).
# Session 49 (2026-12-05): the sweep is done but one point (s49_call{2,3}); every optimum is bracketed.
# Next, in this order (each from the repository root after sweep_prepare.sh, carrying
# .whl, build/ladder_prev and build/xla_cache):
#   ONLY='*L12d384_muon*_seed1' SWEEP=1 bash benchmarks/gpu_runs/calls/next4.sh   (1 point, ~135 s)
#   ONLY='ablations/*_seed0' ABLATIONS=1 bash benchmarks/gpu_runs/calls/next4.sh  (issue 29 item 3:
#     9 points at L12d384, 400 steps, at the tuned rates `ablation_lrs`; ~135 s each, 3 calls), then
#   ONLY='ablations/*_seed1' ABLATIONS=1 ... (the seed spread each switch is judged against).
# Report: python -m launch.ladder --report build/ladder_prev --out=benchmarks/ladder/gpu (the
# ablation table is part of it).
# Session 50 (2026-12-05): stage 2 is complete (L12d384 Muon 8e-3 seed 1: 2.5323) and the ablations'
# baseline and dense_attention ran at seed 0 (s50_call1); then no machine was lent. Next, from the
# repository root after sweep_prepare.sh, carrying .whl, build/ladder_prev and build/xla_cache:
#   ONLY='ablations/*_seed0' ABLATIONS=1 bash benchmarks/gpu_runs/calls/next4.sh   (7 left, ~3 a call)
#   ONLY='ablations/*_seed1' ABLATIONS=1 ...                                         (9, ~3 calls)
# Session 54 (2026-12-05, an H100): full_depth_kv and engram_off at seed 0 (s54_call5); plain_residual
# finished (eval loss 2.6032 in s54_call6/log.txt) but its call ran under `timeout 245` with END at its
# default 545, so the archive step never came and the point is lost. A call shorter than 600 s must set
# END to match: END=$((T - 40)) for `timeout T` (the report and the archive take ~15-35 s). Next:
#   ONLY='ablations/*_seed0' ABLATIONS=1 bash benchmarks/gpu_runs/calls/next4.sh   (5 left, ~3 a call)
#   ONLY='ablations/*_seed1' ABLATIONS=1 ...                                         (9, ~3 calls)
# Session 57 (2026-12-06, an H100): seed 0 is complete (plain_residual again, qat, candidate_pool, adamw,
# bf16_streams: s57_ablations/). The baseline (seed 0) ran before session 54's parameter renumbering,
# which draws other initial weights, so run it again with the seed-1 points, all at one code version:
# after sweep_prepare.sh (or untarring s57_ablations/ladder_gpu.tar.gz into build/ladder_prev),
#   rm -rf build/ladder_prev/ablations/baseline_seed0
#   ONLY='ablations/baseline_seed0,ablations/*_seed1' ABLATIONS=1 bash benchmarks/gpu_runs/calls/next4.sh
# (10 points, ~150-165 s each on an H100: ~3 a call, END=$((T - 40)) for `timeout T`).
# Session 58 (2026-12-06, an H100): baseline_seed0 again (2.5389; 2.5111 before the renumbering) and
# baseline_seed1 (2.5524): spread 0.0135 (s58_ablations/). 8 seed-1 points are left (~3 a call):
# untar s58_ablations/ladder_gpu.tar.gz into build/ladder_prev, then
#   ONLY='ablations/*_seed1' ABLATIONS=1 END=$((T - 40)) bash benchmarks/gpu_runs/calls/next4.sh
# carrying .whl and build/ladder_prev (a fresh machine compiles each point's program: the first
# point took 211 s, the next 156 s). dense_attention_seed0 ran before the renumbering as well (other
# initial weights): add ablations/dense_attention_seed0 (removed first) once seed 1 is done.
# Session 59 (an H100): dense_attention_seed1 2.6036, full_depth_kv_seed1 2.4905, engram_off_seed1
# 2.7223 (s59_ablations/, 145-165 s each). 5 seed-1 points are left (~3 a call): untar
# s59_ablations/ladder_gpu.tar.gz into build/ladder_prev, then the same command
#   run(command="ONLY='ablations/*_seed1' ABLATIONS=1 END=560 bash benchmarks/gpu_runs/calls/next4.sh",
#       carry=[".whl", "build/ladder_prev"], timeout_s=600)
# twice, then `rm -rf build/ladder_prev/ablations/dense_attention_seed0` and ONLY='ablations/dense_attention_seed0'.
# Session 60 (an H100, two calls on one warm machine): the five seed-1 points are done (s60_ablations_call{1,2}/).
# dense_attention_seed0 was NOT run again: the second call was on the warm machine, whose build/ladder_gpu
# still held the old point, so removing it from build/ladder_prev was not enough ("done, skipped"). RERUN
# (comma-separated point names) now removes those points from the machine's workdir after the restore,
# warm machine or not. Next (one point, ~160-210 s on a fresh machine; untar s60_ablations_call2's archive
# into build/ladder_prev first):
#   run(command="RERUN=ablations/dense_attention_seed0 ONLY=ablations/dense_attention_seed0 ABLATIONS=1 END=400 bash benchmarks/gpu_runs/calls/next4.sh",
#       carry=[".whl", "build/ladder_prev"], timeout_s=450)
# JOBS=2 may fit more points a call: with no point yet timed at 2 at once, each is estimated at
# twice its time alone (ladder_jobs.estimate_seconds), so the first such call starts only 2 points;
# later calls time them by what the first measured.
# The carried build/clean was ~59 MB of the 64 MiB a carry may hold (the compilation cache is 38 MB,
# 19 programs): if a call's new entries would pass it, drop the oldest entries of build/xla_cache
# (AdamW's L8d256 programs are no longer needed after stage 2's L8d256 AdamW point).
# Before each call: `mkdir -p build/clean/build/ladder_prev` and unpack every earlier call's
# ladder_gpu.tar.gz there (tar -xzf ... -C build/clean/build/ladder_prev): its done points are
# copied in and skipped, and their timings drive the time limit's estimates.
# Never carry build/ladder_gpu itself: on a warm machine that would replace the workdir and its checkpoints.
#
# Time: the ladder stops itself by END (default 545) s after the start (--time_limit; exit 75 when
# points are left; a running point is stopped there only when its size had no finished point to
# time it by), `timeout` 15 s later is the backstop; the report and the archive by ~580 s at worst. $OUT
# (at most 8 files come back): log.txt, report.md, ladder_gpu.tar.gz (point.json, metrics.jsonl
# and train.log of every point, and the report's files; no checkpoints).
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
# The persistent compilation cache travels between calls (each call is a fresh machine): points of one
# size and chain share their programs (the schedule is an input of the train step), so a later call's
# points skip ~30-40 s of compile each. Kept in build/xla_cache (carried with build/clean); the
# entries a call adds come back as $OUT/xla_cache_new.tar.gz.NN (see `step cache` below).
CACHE=~/.cache/dsv41_jax/xla
if [ -d build/xla_cache ]; then
  step "compilation cache: $(ls build/xla_cache | wc -l) entries restored"
  mkdir -p $CACHE && cp -r build/xla_cache/. $CACHE/
fi
# RERUN: points to run again although a done copy was restored or is left on a warm machine.
for p in ${RERUN//,/ }; do step "rerun: $p removed from $W"; rm -rf "${W:?}/$p"; done
END=${END:-545}
: "${ONLY:=*}" "${JOBS:=1}"
step "ladder ${SWEEP:+sweep }${ABLATIONS:+ablations }$ONLY, $JOBS at once, $((END - SECONDS)) s"
timeout -s INT -k 15 $((END - SECONDS + 15)) python3 -m launch.ladder --config=configs/ladder.py:gpu \
    --workdir=$W --jobs=$JOBS --only="$ONLY" --time_limit=$((END - SECONDS)) ${SWEEP:+--sweep} ${ABLATIONS:+--ablations}
step report; timeout 20 python3 -m launch.ladder --report $W > $OUT/report.md
step archive; (cd $W && find . -maxdepth 3 -type f \( -name point.json -o -name metrics.jsonl -o -name train.log \
    -o -name 'ladder.*' -o -name report.md -o -name '*.png' \) -print0 | tar --null -czf "$OUT/ladder_gpu.tar.gz" -T -)
# Only the entries this call added go back (the whole cache passed $OUT's 16 MiB a file on
# 2026-12-03, session 43), in parts of 15 MB: `cat xla_cache_new.tar.gz.* | tar -xz -C
# build/clean/build/xla_cache` adds them to what the next call carries.
step cache; if [ -d $CACHE ]; then
  (cd $CACHE && for f in *; do [ -e "$OLDPWD/build/xla_cache/$f" ] || echo "$f"; done) > /tmp/new_entries
  echo "$(wc -l < /tmp/new_entries) new entries"
  if [ -s /tmp/new_entries ]; then
    tar -czf - -C $CACHE -T /tmp/new_entries | split -b 15000000 -d - "$OUT/xla_cache_new.tar.gz."
    n=$(ls $OUT/xla_cache_new.tar.gz.* | wc -l)
    [ $n -le 5 ] || { echo "new cache entries over 5 parts, not sent back"; rm $OUT/xla_cache_new.tar.gz.*; }
  fi
fi
ls -l $OUT
step done
