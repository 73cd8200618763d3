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
# Done (4 seeds, session 46: within noise). It is now ab_seeds.sh with these two arms.
# Read: python benchmarks/seed_ab.py --a 'DIR/f32_seed*' --b 'DIR/bf16_seed*' (DIR = $OUT's copy).
A=model.hc_stream_dtype=float32 B=model.hc_stream_dtype=bfloat16 NAME_A=f32 NAME_B=bf16 \
    SEEDS="${SEEDS:-0 1 2 3}" exec bash benchmarks/gpu_runs/calls/ab_seeds.sh
