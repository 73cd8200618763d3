# Issue 26's indexer on either card (~330 s; carry .whl; from the repository root): session 57's
# Triton select (the K-th key 1, 2 or 4 bits a reduction, one packed running sum, and inside
# the indexer kernel the keys made from the masked scores, so no key array) against its 1-bit form
# and the XLA forms, selection alone at top-256 and top-512; then the indexer's scores + selection
# and forward + backward against the XLA reference (issue 26 asks 5x; 3.1x / 4.1x at session 47).
# The select ran 0.95 ms of the indexer's 2.55 ms forward on the H200. The bits per reduction are
# timed at 1 (the default: the first form's 32 reductions, 1-D), 2 and 4 (a [4, N] and a [16, N]
# compare block, so far lowered to Triton IR on the CPU only); make the fastest `triton_topk`'s
# default (the indexer kernel takes the default).
#   run(command="bash benchmarks/gpu_runs/calls/next_s58_idx.sh", carry=[".whl"], timeout_s=420)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "selection and indexer at s3's shapes"
OUT=$OUT timeout -s TERM 380 python3 -u benchmarks/csa2_kernels_gpu.py --reps 5 --deadline 340 \
    --cases check,topk-4k,idx-4k,topk-4k-k512 | grep -v "^ROW"
step done
