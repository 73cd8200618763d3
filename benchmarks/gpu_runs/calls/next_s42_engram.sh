# Next session (s42), one call (~540 s; carry .whl, and build/base where the device copy has no
# .git): the Engram layer out of the layer scan (issue 28), A/B of the train step on one H200.
# base = f506d2c, the commit before the change (the Engram injection under a lax.cond in every
# scanned layer of its run); new = this tree (the run split around its Engram layer,
# dsv41_jax/model.py:run_pieces). Run from a clean worktree of main:
#   git worktree add build/clean HEAD && cp -r .whl build/clean/
#   run(command="cd build/clean && bash benchmarks/gpu_runs/calls/next_s42_engram.sh", carry=[".whl", "build/clean"])
# build/base is made on the device from git (`git archive`); where the copy there has no .git, make
# it here first and it travels inside build/clean:
#   mkdir -p build/clean/build/base && git archive f506d2c benchmarks configs data dsv41_jax launch \
#       optim pallas_kernels | tar -x -C build/clean/build/base   # 6 MB
# What to expect: the cond copied the whole residual stream out of its skip branch at every
# non-Engram layer (~10.8 GB of copies a step at s3, ~17.5 ms a step at m3) and read its predicate
# back to the host inside the loop; read "step ms" (and the host's wait, if gpu_step prints it)
# of base against new for each size. Compile time: CPU s1 / s3 train step (launch.aot) in the commit.
source benchmarks/gpu_runs/calls/prelude.sh
BASE=f506d2c
TREES="benchmarks configs data dsv41_jax launch optim pallas_kernels"   # what gpu_step imports
if [ ! -d build/base ]; then
  mkdir -p build/base && git archive "$BASE" $TREES | tar -x -C build/base || { echo "no build/base"; exit 1; }
fi
ab() {  # $1: size, $2: seconds for each of base and new
  step "$1 4x4096, base ($BASE)"; (cd build/base && timeout -s TERM "$2" python3 -u benchmarks/gpu_step.py \
      --sizes "$1" --batch 4 --seq 4096 --steps 3 --no_split --json "$OUT/$1_base.json" | tail -4)
  step "$1 4x4096, new"; timeout -s TERM "$2" python3 -u benchmarks/gpu_step.py \
      --sizes "$1" --batch 4 --seq 4096 --steps 3 --no_split --json "$OUT/$1_new.json" | tail -4
}
ab m3 130
ab s3 $(( (540 - SECONDS) / 2 ))
step done
