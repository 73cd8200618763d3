# Issue 27: s3's accumulated step with the fused mHC site (`pallas_kernels/mhc_site.py`) as the op
# `hc_site`'s kernel, side by side with main (either card, ~560 s; carry .whl; from the repository
# root). Run after next_s59_kernels.sh has timed the site standalone (and set its best tiles as
# the defaults). The copy swaps the registered kernel of the op's row in pallas_kernels/dispatch.py
# (checked on the CPU, session 58: tests/pallas_kernels/test_coverage.py passes on that copy, the
# model path and the 8-device mesh included). If "fused" is faster beyond the arms' spread,
# register it so on main (and its "auto" rule with the measurement), then profile: the mHC
# component is issue 27's <= 40 ms.
#   run(command="bash benchmarks/gpu_runs/calls/next_s59_fused_step.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_copy fused pallas_kernels/dispatch.py \
    's/Kernel("pallas_kernels.mhc:hc_site",/Kernel("pallas_kernels.mhc_site:hc_site",/' || exit 1
arms s3 270 main fused@/tmp/tree_fused
step done
