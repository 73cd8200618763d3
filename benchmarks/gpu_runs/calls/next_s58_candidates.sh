# Two candidate changes from session 57's H100 profile (s57_prof), kept off main until measured,
# s3's accumulated step side by side (either card; carry .whl; from the repository root):
#   - pallas_kernels/mhc.py: an optimization barrier on hc_site's X' (bfloat16), so the collapse,
#     the mix and the backward's readers read it, not a float32 copy of expand's sum (37 f32
#     [4, 4096, 4, 1024] buffers a micro-batch, 6.3 ms of writes on the H100, each read 2-3 times);
#     the same values by construction.
#   - dsv41_jax/layers/rope.py: RoPE as one elementwise pass over the width (x·cos + swap(x)·sin
#     with a select), no slice-and-concatenate (3.3 ms of concatenates a micro-batch on the H100);
#     the same arithmetic (bit for bit op by op; compiled, XLA's contraction may round float32
#     differently before the cast, as the CPU showed: tiny's loss equal, gradients within 2e-4 of each leaf's largest).
# The edits are benchmarks/gpu_runs/calls/s57_candidate.py (with the new test in test_rope.py). If
# "cand" is faster beyond the arms' spread, apply them to main (`python3 ...s57_candidate.py .`)
# and delete the script, then profile: the mHC and attention
# components tell each change's share (then keep only what pays).
#   run(command="bash benchmarks/gpu_runs/calls/next_s58_candidates.sh", carry=[".whl"], timeout_s=600)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
tree_edit cand benchmarks/gpu_runs/calls/s57_candidate.py || exit 1
arms s3 270 main cand@/tmp/tree_cand
# An H200 compiles the two arms at once (~300 s), leaving time for the candidate's profile.
if [ $SECONDS -lt 330 ]; then (cd /tmp/tree_cand && profile s3 cand); fi
step done
