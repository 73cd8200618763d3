# The mHC site rows again with `time_calls` timing bursts (session 64's change): the registered
# kernel's forward+backward against the card's copy rate, both back to back. Either card, ~150 s.
#   run(command="bash benchmarks/gpu_runs/calls/next_s64_site_burst.sh", carry=[".whl"], timeout_s=190)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
step "site: reference, kernel, copy (bursts)"
timeout -s TERM ${SITE_SECS:-150} python3 -u benchmarks/mhc_moe_gpu.py --only=site --copy --reps 20 \
    --budget-s $(( ${SITE_SECS:-150} - 30 )) --json=$OUT/site.json 2>&1 \
    | grep -v "^WARNING\|DeprecationWarning\|warnings.warn" | grep "^case="
step done
