# The mHC site rows again with `time_calls` timing bursts (session 64's change): the registered
# kernel's forward+backward against the card's copy rate, both back to back. Either card, ~150 s.
#   run(command="bash benchmarks/gpu_runs/calls/next_s64_site_burst.sh", carry=[".whl"], timeout_s=190)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
site_burst
step done
