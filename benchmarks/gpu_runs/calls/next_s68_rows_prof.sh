source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python3 -u benchmarks/gpu_runs/calls/s68_rows_prof.py 2>&1 | grep -v "WARNING\|Deprecat\|warnings.warn"
