# Ran in session 51 (benchmarks/gpu_runs/2026-12-05/s51_call1: main 2,218 / main2 2,192, scatters_back 2,206,
# router_6x 2,175, engram_ckpt 2,435 ms; RESULTS "The three rows on the H200"). As written for it
# (issues 27 and 28, ~580 s; carry .whl; from the repository root): s3's accumulated
# step (8 x (4 x 4096)), two arms at a time compiled at once and timed in turn (prelude `arms`):
#   main, main2     the tree as committed; two rows give the call's own noise
#   scatters_back   session 51's two scatters put back (s51_scatters_back.patch: the balance loss's
#                   segment_sums, ~1.4 ms a micro-batch in the 2026-12-03 profile, and the dropless
#                   group sizes' colliding scatter-add, ~0.36 ms): is the step shorter without them?
#   router_6x       model.router_precision=bf16_6x: the router's float32 product and its transposes
#                   on tensor cores (~3.8 ms a micro-batch at HIGHEST in the 2026-12-03 profile)
#   engram_ckpt     the Engram injection under its own jax.checkpoint inside the layer scan's
#                   lax.cond: the cond's forward then returns the injection's inputs as its residuals
#                   (the streams in bf16, the memory) instead of its float32 intermediates, so the
#                   skipping layers fill ~140 µs of zeros instead of ~410 (RESULTS, session 51), for
#                   one more injection forward in the Engram layer's backward
#   run(command="bash benchmarks/gpu_runs/calls/next_s51_perf.sh", carry=[".whl"], timeout_s=600)
# A faster router_6x beyond the main rows' spread: its s1 loss A/B (ab_seeds.sh, A=
# 'model.router_precision=highest' B='model.router_precision=bf16_6x', seeds 0-3), then the default
# for s3 / s4 / m3 in configs/small.py; then the s3 profile (`gpu_profile.py --size s3 --batch 4
# --seq 4096`) for RESULTS' by-source table.
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
rm -rf /tmp/tree_scatters_back && mkdir -p /tmp/tree_scatters_back && cp -a . /tmp/tree_scatters_back/ \
  && patch -d /tmp/tree_scatters_back -p1 < benchmarks/gpu_runs/calls/s51_scatters_back.patch || exit 1
tree_copy engram_ckpt dsv41_jax/model.py 's/inject = lambda X: engram.inject(X, memory_kv, token_mask)/inject = jax.checkpoint(lambda X: engram.inject(X, memory_kv, token_mask))/' || exit 1
arms s3 240 main scatters_back@/tmp/tree_scatters_back
arms s3 240 router_6x:model.router_precision=bf16_6x engram_ckpt@/tmp/tree_engram_ckpt
[ $SECONDS -lt 400 ] && arms s3 180 main2
step done
