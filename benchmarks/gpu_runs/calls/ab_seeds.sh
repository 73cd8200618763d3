# A loss A/B on s1 over seeds, each seed's two arms trained at once on the one H200 (two processes,
# 45 % of its memory each; ~245 s a seed, so two seeds a call). From the repository root:
#   run(command="A='model.moe_product_dtype=float32' B='model.moe_product_dtype=compute' \
#       SEEDS='0 1' bash benchmarks/gpu_runs/calls/ab_seeds.sh", carry=[".whl"], timeout_s=600)
# A and B: space-separated KEY=VALUE config overrides (without --config.); NAME_A / NAME_B name the
# arms' directories (default a, b). Read: python benchmarks/seed_ab.py --a 'DIR/a_seed*' --b 'DIR/b_seed*'
# over the calls' copies in one directory. A seed starts only with ~260 s left of the 545.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
S1="--config=configs/small.py:s1 --config.train.steps=200 --config.train.eval_every=200 \
    --config.train.eval_batches=16 --config.train.log_every=20 --config.train.checkpoint_every=1000 \
    --config.train.progress_bar=false --config.optim.warmup_steps=20"
overrides() { local kv; for kv in $1; do printf -- '--config.%s ' "$kv"; done; }
arm() {  # $1 arm name, $2 seed, $3 overrides
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout -s INT $(( 545 - SECONDS )) python3 -m launch.train $S1 \
      --workdir=/tmp/ab/$1_seed$2 --config.train.seed=$2 $(overrides "$3") > /tmp/ab_$1_$2.out 2>&1
  mkdir -p $OUT/$1_seed$2 && cp /tmp/ab/$1_seed$2/{metrics.jsonl,train.log} $OUT/$1_seed$2/ 2>/dev/null
  grep -h "held-out\|error" /tmp/ab_$1_$2.out | tail -2
}
NA=${NAME_A:-a} NB=${NAME_B:-b}
step "A ($NA): ${A:-defaults}; B ($NB): ${B:-defaults}"
for seed in ${SEEDS:-0 1}; do
  [ $SECONDS -lt 285 ] || { echo "no time for seed $seed"; break; }
  step "seed $seed: both arms at once"
  # wait for the arms by pid: a bare `wait` also waits for the prelude's tee, which never ends
  arm $NA $seed "${A:-}" & pa=$!
  arm $NB $seed "${B:-}" & pb=$!
  wait $pa $pb
done
step summary
python3 benchmarks/seed_ab.py --a "$OUT/${NA}_seed*" --b "$OUT/${NB}_seed*"
step done
