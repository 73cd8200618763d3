# Run here (not on the device), from the repository root of a fresh checkout, before a sweep call of
# next4.sh: unpacks every earlier call's ladder archive into build/ladder_prev, whose done points
# next4.sh restores and skips (their timings drive its time limit). Then, with everything committed:
#   run(command="ONLY='...' SWEEP=1 bash benchmarks/gpu_runs/calls/next4.sh",
#       carry=[".whl", "build/ladder_prev", "build/xla_cache"], timeout_s=600)
# (.whl: benchmarks/gpu_runs/calls/prelude.sh's wheels, see the device README; build/xla_cache: the
# compilation cache's entries, if a call sent some back: cat xla_cache_new.tar.gz.* | tar -xz -C
# build/xla_cache.) After the call: copy its files to benchmarks/gpu_runs/<date>/<name>/, run this
# again, and regenerate the report:
#   python -m launch.ladder --report build/ladder_prev --out=benchmarks/ladder/gpu
set -euo pipefail
mkdir -p build/ladder_prev build/xla_cache
n=0
for t in benchmarks/gpu_runs/*/*/ladder_gpu.tar.gz; do
  tar -xzf "$t" -C build/ladder_prev && n=$((n + 1))
done
echo "$n archives unpacked; $(grep -rl '"status": "done"' build/ladder_prev --include=point.json | wc -l) points done"
