# Session 61 (a record: it ran on an H100, issue 29's last point; next_s62_any.sh is the next call): whichever card comes (carry .whl; build/ladder_prev too if the checkout has it; from the
# repository root).
#   run(command="bash benchmarks/gpu_runs/calls/next_s61_any.sh", carry=[".whl", "build/ladder_prev"],
#       timeout_s=600)
# An H200 (> 100 GiB) runs next_s60_h200.sh (m3's accumulated step and s3 by source on the H200:
# issues 26-28); then take next_s61_m3prof.sh and next_s61_m3train.sh on the same warm machine.
# An H100 runs issue 29's last point: dense_attention at seed 0 with today's code (its point predates
# session 54's parameter renumbering), removed first from the machine's workdir (RERUN) so that a warm
# machine's old copy is not taken for done (session 60 lost its rerun that way). Without a local
# build/ladder_prev the done points come from session 60's archive (every point of the ladder).
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${gpu_mib:-0}" -ge 102400 ]; then
  exec bash benchmarks/gpu_runs/calls/next_s60_h200.sh
fi
if [ ! -d build/ladder_prev ]; then
  mkdir -p build/ladder_prev
  tar -xzf benchmarks/gpu_runs/2026-12-06/s60_ablations_call2/ladder_gpu.tar.gz -C build/ladder_prev
fi
RERUN=ablations/dense_attention_seed0 ONLY=ablations/dense_attention_seed0 ABLATIONS=1 END=540 \
    exec bash benchmarks/gpu_runs/calls/next4.sh
