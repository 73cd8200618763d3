# Session 68's call on an H200 (needs_h200; ~590 s): the rows site kernel against the registered one
# and -X in bursts (issue 27's >= 60 % of copy), then s3 by source (issues 26/27's in-step figures)
# with whichever site kernel was faster forward+backward (the rows one through a tree copy).
#   run(command="bash benchmarks/gpu_runs/calls/next_s68_h200.sh", carry=[".whl"], timeout_s=600,
#       kind="nvidia-h200", needs_h200=true)
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
SITE_SECS=230 site_burst --rows-tiles 4x256w4/16x32w4 8x256w8/16x64w8
faster=$(python3 - "$OUT/site.json" <<'PY'
import json, sys
try:
  rows = json.load(open(sys.argv[1]))
  rows = rows if isinstance(rows, list) else rows.get("rows", [])
  t = {r["impl"]: r["ms"] for r in rows if r.get("case") == "mhc site fwd+bwd" and "ms" in r}
  print("rows" if t.get("rows", 1e9) < t.get("kernel", 0) else "main")
except Exception as e:
  print("main")
PY
)
echo "faster site: $faster"
if [ "$faster" = rows ]; then
  rows_tree || exit 1
  (cd /tmp/tree_rows && profile s3 s3_h200_rows)
else
  profile s3 s3_h200
fi
step done
