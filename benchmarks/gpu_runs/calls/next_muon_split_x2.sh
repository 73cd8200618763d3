# For a session lent two GPUs (kind nvidia-h200-x2; ~450 s; carry .whl; from the repository root):
# Muon's Newton–Schulz split by items over the devices (optim.ns_split=items, the default since
# session 48: each GPU iterates half of every parameter's whole matrices) against XLA's own
# partitioning of the one-device batches (ns_split=xla: each GPU iterates nearly every matrix), on
# s3 with fsdp:2, 8 micro-batches of 8 x 4096 a step (4 rows a GPU), 14 steps each.
#   run(command="bash benchmarks/gpu_runs/calls/next_muon_split_x2.sh", carry=[".whl"],
#       kind="nvidia-h200-x2", timeout_s=600)
# Compare the median step_time of steps 7-14 (the first steps share the host with the second ViT
# phase's compile) and each run's "train step compiled in"; on one GPU the optimizer was ~9 % of
# s3's accumulated step (RESULTS), so items should take about half of that off per GPU. Then
# RESULTS ("Muon on two GPUs") and design §T2's sentence on the split.
source benchmarks/gpu_runs/calls/prelude.sh
S3="--config=configs/small.py:s3 --config.data.batch_size=64 --config.data.seq_len=4096 \
    --config.model.seq_len=4096 --config.train.eval_every=0 --config.train.checkpoint_every=1000 \
    --config.train.progress_bar=false --config.mesh.fsdp=2 --config.mesh.data=1 \
    --config.train.grad_accum_steps=8 --config.train.steps=14 --config.train.log_every=1"
for split in items xla; do
  step "s3 fsdp:2 ns_split=$split"
  timeout -s INT 260 python3 -m launch.train $S3 --config.optim.ns_split=$split \
      --workdir=/tmp/s3_$split 2>&1 | grep -v step_time | tail -6
  grep -h "step_time\|compiled in" /tmp/s3_$split/train.log | tail -16
  cp /tmp/s3_$split/train.log "$OUT/train_$split.log" 2>/dev/null
done
step done
