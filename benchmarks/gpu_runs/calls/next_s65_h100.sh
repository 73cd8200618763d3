# Session 65's call for an H100 (or either card; ~580 s; carry .whl):
#   1. issue 28: s3's accumulated step with the head loss that makes its logits once (main, this
#      session) against the loss before it (s65_loss_before.patch, the change reversed: the logits
#      made again in the backward), one arm after the other on an H100 (compiled at once on an H200);
#   2. issues 26 and 27: s3 by source at 4 x 4096 if time is left (profile's own limit: 585 s into
#      the call).
#   run(command="bash benchmarks/gpu_runs/calls/next_s65_h100.sh", carry=[".whl"], timeout_s=600,
#       kind="nvidia-h100-x1", needs_h200=false)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
rm -rf /tmp/tree_oldloss && mkdir -p /tmp/tree_oldloss && cp -a . /tmp/tree_oldloss/ \
  && patch -d /tmp/tree_oldloss -p1 < benchmarks/gpu_runs/calls/s65_loss_before.patch || exit 1
arms s3 ${ARM_SECS:-190} main oldloss@/tmp/tree_oldloss
[ $SECONDS -lt 420 ] && profile s3 "s3_$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -dc 'A-Za-z0-9')"
step done
