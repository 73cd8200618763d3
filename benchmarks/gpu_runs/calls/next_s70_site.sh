# Session 70's second call (any card, ~330 s; warm after next_s70.sh): what session 69 registered untimed:
# the rows site kernel with float32 streams at s3's shapes (s1 and s2 keep float32 streams; "auto" runs
# the rows kernel for them too), then at d 4096 / 5120 (the forward's halved token rows,
# `mhc_rows.forward_tiles`) beside the earlier kernel and the XLA reference (kernels_gpu.py).
#   run(command="bash benchmarks/gpu_runs/calls/next_s70_site.sh", carry=[".whl"], timeout_s=360)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
SITE_SECS=140 site_burst --streams=float32
step "kernels_gpu site at d 4096 / 5120 (bf16 streams)"
timeout -s TERM 170 python3 -u benchmarks/kernels_gpu.py --cases copy,site,site_grad \
    --site-shapes 16384x4096,8192x5120 --reps 10 --json "$OUT/kernels_site.json" 2>&1 \
    | grep -v "^WARNING\|DeprecationWarning\|warnings.warn" | tail -30
step done
