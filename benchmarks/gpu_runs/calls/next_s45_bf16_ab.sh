# Next session (issue 27 item 1's option, ~540 s; carry .whl; from the repository root): the loss
# A/B of the bfloat16 mHC streams (`model.hc_stream_dtype`, docs/design.md §3.5) on s1, 4 seeds,
# each seed's two arms trained at once on the one H200 (two processes, 45 % of its memory each).
# Session 44 measured the speed (s3, 8 x (4 x 4096): 2,777.0 -> 2,309.3 ms a step, MFU 8.6 -> 10.3 %);
# the switch becomes s3's / m3's default only if the loss is within seed noise here.
#   run(command="bash benchmarks/gpu_runs/calls/next_s45_bf16_ab.sh", carry=[".whl"], timeout_s=600)
# SEEDS (default "0 1 2 3") picks the seeds. Session 45 measured a seed (both arms at once) at
# 234-248 s, so a call fits two: seeds 0 and 1 are done (benchmarks/gpu_runs/2026-12-03/s45_call{2,3});
# next: SEEDS="2 3". A seed starts only if ~260 s are left of the 545 (a seed stopped by the
# timeout loses its metrics: it had not reached its evaluation).
# Read: python benchmarks/seed_ab.py --a 'DIR/f32_seed*' --b 'DIR/bf16_seed*' (DIR = $OUT's copy).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
S1="--config=configs/small.py:s1 --config.train.steps=200 --config.train.eval_every=200 \
    --config.train.eval_batches=16 --config.train.log_every=20 --config.train.checkpoint_every=1000 \
    --config.train.progress_bar=false --config.optim.warmup_steps=20"
arm() {  # $1 arm name, $2 seed, $3 dtype
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout -s INT $(( 545 - SECONDS )) python3 -m launch.train $S1 \
      --workdir=/tmp/ab/$1_seed$2 --config.train.seed=$2 --config.model.hc_stream_dtype=$3 \
      > /tmp/ab_$1_$2.out 2>&1
  mkdir -p $OUT/$1_seed$2 && cp /tmp/ab/$1_seed$2/{metrics.jsonl,train.log} $OUT/$1_seed$2/ 2>/dev/null
  grep -h "held-out\|eval\|done\|error" /tmp/ab_$1_$2.out | tail -3
}
for seed in ${SEEDS:-0 1 2 3}; do
  [ $SECONDS -lt 285 ] || { echo "no time for seed $seed"; break; }
  step "seed $seed: float32 and bfloat16 streams at once"
  # wait for the two arms by pid: a bare `wait` also waits for the prelude's `tee` (a process
  # substitution), which never ends; that hung every call of sessions 45-46 after its first seed
  arm f32 $seed float32 & a=$!
  arm bf16 $seed bfloat16 & b=$!
  wait $a $b
done
step summary
python3 benchmarks/seed_ab.py --a "$OUT/f32_seed*" --b "$OUT/bf16_seed*"
step done
