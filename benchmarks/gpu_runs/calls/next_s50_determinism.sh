# Is a GPU rerun of the same point bitwise the same run? (2026-12-05, session 50: the :gpu ablation
# baseline at seed 0 and the sweep's L12d384 Muon 8e-3 seed 0 are one config apart only in
# eval_every, and their training losses already differ at step 10: 7.0341 against 7.0385.)
# Four runs of that point for STEPS steps, logged every step: twice as it is, twice with XLA's
# deterministic ops (--xla_gpu_deterministic_ops=true; also excludes the nondeterministic
# scatter/select-and-scatter algorithms). Prints the first step where each pair's losses differ.
#   run(command="STEPS=20 LIMIT=90 bash benchmarks/gpu_runs/calls/next_s50_determinism.sh",
#       carry=[".whl", "build/xla_cache"], timeout_s=420)
# (each run is cut at LIMIT seconds, default 110: four runs need up to 4 x LIMIT + the prelude;
# ~250 s expected with the compilation cache carried.)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
CACHE=~/.cache/dsv41_jax/xla
[ -d build/xla_cache ] && mkdir -p $CACHE && cp -r build/xla_cache/. $CACHE/
STEPS=${STEPS:-30}
one() {  # $1 name, $2 extra XLA flags
  step "$1 (${2:-no extra flags})"
  XLA_FLAGS="$2" timeout -s INT ${LIMIT:-110} python3 -m launch.train \
      --config=configs/ladder.py:gpu/L12d384/400/baseline --workdir=/tmp/det/$1 \
      --config.train.steps=$STEPS --config.train.log_every=1 --config.train.eval_every=0 \
      --config.train.checkpoint_every=100000 --config.train.progress_bar=false > /tmp/det_$1.out 2>&1
  echo "rc $?"; tail -2 /tmp/det_$1.out
  mkdir -p $OUT/$1 && cp /tmp/det/$1/metrics.jsonl $OUT/$1/ 2>/dev/null
}
one plain_a; one plain_b
one det_a --xla_gpu_deterministic_ops=true; one det_b --xla_gpu_deterministic_ops=true
step compare
python3 - $OUT <<'PY'
import json, os, sys
def losses(name):
  path = os.path.join(sys.argv[1], name, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  return {r["step"]: (r["loss"], r.get("grad_norm")) for r in map(json.loads, open(path)) if "loss" in r}
for a, b in (("plain_a", "plain_b"), ("det_a", "det_b"), ("plain_a", "det_a")):
  la, lb = losses(a), losses(b)
  if la is None or lb is None:
    print(f"{a} vs {b}: missing run"); continue
  diff = [s for s in sorted(la) if s in lb and la[s] != lb[s]]
  print(f"{a} vs {b}: {len(la)} steps, " + (f"first differs at step {diff[0]}: {la[diff[0]]} vs "
        f"{lb[diff[0]]}; last {la[max(la)]} vs {lb[max(lb)]}" if diff else "bitwise equal losses and grad norms"))
PY
step done
