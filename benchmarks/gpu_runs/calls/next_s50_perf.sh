# Next session (issue 28, ~450 s; carry .whl; from the repository root): s3's accumulated step
# (8 x (4 x 4096)) with the Engram layer reached without a lax.cond (`model.engram_scan=split`,
# session 50) against the cond form, two arms at a time compiled at once and timed in turn (prelude
# `arms`, gpu_step.py --turn; ~126 s a pair in session 49):
#   main, main2   the tree as committed (engram_scan=cond); two rows give the call's own noise
#   split         the run scanned in two parts around its Engram injection: the profile of
#                 2026-12-03 put ~5 ms a micro-batch (~40 ms a step) in the cond's copies and fusions
#                 (model.py's engram_at line: 132 copies 2.69 ms, 88 fusions 2.30 ms), against a
#                 second compiled copy of the layer body for each run holding an Engram layer
#                 Compiled on the CPU (session 50, `launch.aot --config=configs/small.py:s3
#                 --mesh=data:1 --batch=4 --seq=1024 --max_compile_params=1e10
#                 --config.train.grad_accum_steps=1 --config.model.engram_scan=...`): compile 47.0 ->
#                 53.5 s, temporaries 27.9 -> 40.0 GiB (each part's weight-gradient stack beside
#                 the run's whole one): affordable at s3 (43.6 GiB of 139), to be checked at m3
#   split_cast    split with `model.cast_weights_once=true` (alone: -11.6 ms, session 46)
#   run(command="bash benchmarks/gpu_runs/calls/next_s50_perf.sh", carry=[".whl"], timeout_s=600)
# A winner beyond the main rows' spread (and compile still <= 90 s) becomes s3's and m3's default
# (configs/small.py), with design §T8 and RESULTS; then the s3 profile (`gpu_profile.py --size s3
# --batch 4 --seq 4096 --steps 2`) to confirm the copies are gone.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
arms s3 240 main split:model.engram_scan=split
arms s3 240 split_cast:model.engram_scan=split,model.cast_weights_once=true main2
step done
