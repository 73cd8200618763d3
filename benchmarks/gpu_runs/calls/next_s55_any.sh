# Session 55, whichever card comes (carry .whl; from the repository root):
#   run(command="bash benchmarks/gpu_runs/calls/next_s55_any.sh", carry=[".whl"], timeout_s=600)
# Issue 28 on an H200 or an H100: s3's accumulated step on main, then with `model.cast_weights_once`
# (session 55: the routed experts' w1 and w3 handed over as one pair, so no [w1 | w3] concatenation
# in each layer's forward and remat pass; ~4 ms a micro-batch on the H100 by session 54's profile,
# ~30 ms a step, plus session 46's 11.6 ms of casts). Each arm its own process, one after another
# (an H100 holds one s3 arm). If the cast arm wins beyond the rows' spread (11-14 ms between calls),
# make `cast_weights_once` the default (dsv41_jax/config.py) and record both rows in RESULTS.
# Then: an H200 -> next_s55_h200.sh (s3's profile with session 55's rules, m3); an H100 -> issue 29's
# ablations (ONLY='ablations/*_seed0' ABLATIONS=1 bash benchmarks/gpu_runs/calls/next4.sh, carrying
# .whl, build/ladder_prev, build/xla_cache after sweep_prepare.sh).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
END=${END:-585}   # a call shorter than 600 s: END = its timeout less 15
accum s3 main $(( (END - SECONDS) / 2 ))
accum s3 cast $(( END - SECONDS )) model.cast_weights_once=true
step done
