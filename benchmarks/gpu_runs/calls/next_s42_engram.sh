# Next session, one call (~540 s; carry .whl and build/clean): the Engram layer out of the layer
# scan (issue 28), A/B of the train step on one H200. base = this tree (main: the Engram injection
# under a lax.cond in every scanned layer of its run); new = branch issue28-engram-pieces (b7ae0d1:
# the run split around its Engram layer, dsv41_jax/model.py:run_pieces), kept off main until it is
# measured: it costs ~15-20 % of CPU compile time (s3 54.6 -> 67.3 s), its gradients differ from
# main's in float32 rounding (loss bit-identical), and on the CPU its program moves 4 % fewer bytes
# (s1: copies 31.6 -> 20.6 GB a step; RESULTS 2026-12-03 session 41). Make it here:
#   git worktree add build/clean HEAD && cp -r .whl build/clean/
#   new = main with aa4a015 reverted (only dsv41_jax/model.py differs from main's model code;
#   b7ae0d1 itself predates main's later launch/ and benchmarks/ changes):
#   git worktree add --detach /tmp/rv main && (cd /tmp/rv && git revert --no-commit aa4a015;
#     git checkout HEAD -- benchmarks/gpu_runs/calls/next_s42_engram.sh)
#   rm -rf build/clean/build/new && mkdir -p build/clean/build/new && (cd /tmp/rv && tar -c \
#     --exclude=__pycache__ benchmarks/*.py benchmarks/gpu_runs/calls configs data dsv41_jax launch \
#     optim pallas_kernels) | tar -x -C build/clean/build/new          # ~1.7 MB
#   (session 43 made it so at c48fc2a; remake it if main's dsv41_jax/ has changed since)
#   run(command="cd build/clean && bash benchmarks/gpu_runs/calls/next_s42_engram.sh", carry=[".whl", "build/clean"])
# (b7ae0d1 is in main's history: the branch is only a name for it.) If new is faster by more than
# the run-to-run spread (~1 %), `git revert aa4a015` (the revert of b7ae0d1) with the figures in
# RESULTS; else delete the branch.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
[ -d build/new ] || { echo "no build/new: make it before the call (header)"; exit 1; }
ab() {  # $1: size, $2: seconds for each of base and new
  step "$1 4x4096, base (main)"; timeout -s TERM "$2" python3 -u benchmarks/gpu_step.py \
      --sizes "$1" --batch 4 --seq 4096 --steps 3 --no_split --json "$OUT/$1_base.json" | tail -4
  step "$1 4x4096, new (issue28-engram-pieces)"; (cd build/new && timeout -s TERM "$2" python3 -u \
      benchmarks/gpu_step.py --sizes "$1" --batch 4 --seq 4096 --steps 3 --no_split \
      --json "$OUT/$1_new.json" | tail -4)
}
ab m3 130
ab s3 $(( (540 - SECONDS) / 2 ))
step done
