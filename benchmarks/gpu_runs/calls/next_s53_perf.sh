# Superseded (session 53): the split is on main since aa10698, so its patch no longer applies to
# main and this script stops at the patch; next_s54_call1.sh measures what is left.
# Session 53 (issue 28, ~560 s; carry .whl; from the repository root): s3's accumulated step
# (8 x (4 x 4096)), two pairs of arms, each pair compiled at once and timed in turn (prelude `arms`):
#   main      the tree as committed
#   split     s52_engram_split.patch (the Engram injection between two scans of its run, no
#             lax.cond in the layer body): ~5 ms a micro-batch expected from the 2026-12-03 profile
#   region    XLA's copy insertion with region analysis (--xla_gpu_copy_insertion_use_region_analysis):
#             the conditionals' pass-through copies (the kind lax.switch: ~3.4 ms a micro-batch, the
#             Engram cond). On the CPU the same flag takes the tiny step's copies 710 -> 643
#   dsfusion  --xla_gpu_enable_dynamic_slice_fusion: the layer scans' slices of the stacked weights
#             and the gradient stacks' updates read / written in place by the products (model.py's
#             scan: ~1,400 kernels a step at 2 x 4 rows, 2026-12-02d)
#   run(command="bash benchmarks/gpu_runs/calls/next_s53_perf.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
rm -rf /tmp/tree_split && mkdir -p /tmp/tree_split && cp -a . /tmp/tree_split/ \
  && patch -s -d /tmp/tree_split -p1 < benchmarks/gpu_runs/calls/s52_engram_split.patch || exit 1
arms s3 260 main split@/tmp/tree_split
export XLA_ARM_region=--xla_gpu_copy_insertion_use_region_analysis=true
export XLA_ARM_dsfusion=--xla_gpu_enable_dynamic_slice_fusion=true
arms s3 $(( 590 - SECONDS )) region dsfusion
step done
