# Next sessions, calls 4+ (issue 29; each <= 570 s; carry .whl): the :gpu ladder grid (~20 min in all), then
# `LADDER_SWEEP=1 bash ...` for its learning-rate sweep (2 sizes x 2 chains x 5 rates x 400 steps, ~37 min).
# The ladder directory is an ignored path of the checkout, kept on the warm machine between calls; every point
# resumes from its checkpoint, so repeating the call continues (a fresh machine starts over). Reports to $OUT.
source benchmarks/gpu_runs/calls/prelude.sh
mkdir -p build/ladder_gpu
step ladder; timeout -s INT 500 python3 -m launch.ladder --config=configs/ladder.py:gpu --workdir=build/ladder_gpu ${LADDER_SWEEP:+--sweep}
step report; timeout 60 python3 -m launch.ladder --report build/ladder_gpu --out=$OUT/ladder_gpu
step done
