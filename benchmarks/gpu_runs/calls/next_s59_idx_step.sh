# Ran once (session 59, s59_idx_step/); a record now: both forms are main's defaults, so its
# tree_copy edit matches nothing and the script stops there.
# Issue 26: s3's accumulated step with the indexer's two session-58 forms as defaults, side by side
# with main (either card, ~560 s; carry .whl; from the repository root). Standalone (session 59,
# H100) the early-exit select and 512-entry score chunks made scores + selection 1.59 ms against
# 2.19 (5.6x the XLA reference's forward); this asks whether the step agrees.
#   run(command="bash benchmarks/gpu_runs/calls/next_s59_idx_step.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_copy idx pallas_kernels/indexer.py \
    's/select = "triton" if N <= _TRITON_MAX_ENTRIES/select = "triton_early" if N <= _TRITON_MAX_ENTRIES/;384s/block_chunk: int | None = None/block_chunk: int | None = 512/' || exit 1
arms s3 270 main idx@/tmp/tree_idx
step done
