# Session 73 (~330 s on an H200, two s3 arms compiled at once; on an H100 one after another, ~2 x 250 s):
# the mHC site in the accumulated s3 step, the rows kernel (main's "auto") against its XLA reference
# (model.ops.hc_site=reference). Why: session 70's profile charges the rows site (the MoE site of every
# layer) 18.8 ms of kernels and fusions a micro-batch plus its share of the mix product, while the
# layer-boundary site, which runs as XLA (block.py site_output + site_input: the same expand, collapse and
# norm), is charged 13.2 ms plus its share; the two were never set side by side in the step since the rows
# kernel replaced the earlier one (session 69 compared those two only).
#   run(command="bash benchmarks/gpu_runs/calls/next_s73_site.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
secs=$(( 570 - SECONDS )); [ "${gpu_mib:-0}" -lt 102400 ] && secs=$(( secs / 2 ))   # H100: one after another
arms s3 $secs main xsite:model.ops.hc_site=reference
step done
