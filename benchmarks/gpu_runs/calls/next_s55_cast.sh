# Session 55's short call (what its budget left; carry .whl): s3's accumulated step with
# `model.cast_weights_once` (the routed experts' gate/up pair) alone, against the main rows of the
# same card in earlier calls (H100, session 54: 2,489.5 / 2,500.4 before the run form, 2,450.1 /
# 2,455.6 after; the rows of one arm differ by 5-11 ms between calls). next_s55_any.sh has both arms.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
accum s3 cast $(( ${END:-585} - SECONDS )) model.cast_weights_once=true
step done
