# Sourced by each device call of 2026-12-01 (late session): the image's missing wheels, logs to $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
step() { echo; echo "=== $(date +%T) $*"; }
# A size's step at issue 28's setting (8 micro-batches of 4 x 4096) by benchmarks/gpu_step.py:
# accum SIZE NAME SECONDS [KEY=VALUE ...] writes $OUT/SIZE_NAME.json (the KEY=VALUEs go to --set);
# s3_accum NAME SECONDS [KEY=VALUE ...] is `accum s3 ...`. MB=rows K=micro-batches in the environment
# take another micro-batch (MB x 4096) and accumulation count (default MB=4 K=8).
accum() {
  local size=$1 name=$2 secs=$3; shift 3
  local mb=${MB:-4} k=${K:-8}
  step "$size $k x ($mb x 4096): $name"
  local gpu_mib; gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  # m3 took 80.7 GiB at 4 x 4096 (an H100 has 80 GB): on such a card only MB=1 or 2 is tried (the
  # analytic plan: ~71 and ~76 GiB), e.g. MB=2 K=16 with XLA_PYTHON_CLIENT_MEM_FRACTION=0.97.
  if [ "$size" = m3 ] && [ "${gpu_mib:-0}" -lt 102400 ] && [ "$mb" -gt 2 ]; then
    echo "skipped: m3 at $mb x 4096 needs ~81 GiB or more, this card has ${gpu_mib} MiB (MB=1 or 2 may fit)"; return 0
  fi
  # One process: 92 % of the card (jax's default 75 % is 60 GiB on an H100).
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92} \
  timeout -s TERM "$secs" python3 -u benchmarks/gpu_step.py --sizes "$size" --batch "$mb" --seq 4096 \
      --grad_accum "$k" --steps 2 --no_split --json "$OUT/${size}_$name.json" ${1:+--set "$@"} | tail -4
}
s3_accum() { accum s3 "$@"; }
# Arms compiled at once and timed in turn (gpu_step.py --turn: two s3 arms should take about one
# arm's init + compile plus both arms' steps; first used by next_s48_perf.sh). arms SIZE SECS NAME[@DIR][:KEY=VALUE,KEY=VALUE] ...: one process per arm,
# each with 1/N of the GPU's memory (less 10 %); @DIR runs the arm in another copy of the tree (see
# `tree_copy`); the variable XLA_ARM_NAME, when set, adds its flags to that arm's XLA_FLAGS; writes $OUT/SIZE_NAME.json and prints each arm's table row. Two s3 arms fit (43.6 GiB
# each at 4 x 4096); m3 (80.7 GiB) does not pair.
# On a card under 100 GiB (an H100: 80 GB holds one s3 arm, not two, and no m3) the arms of a size
# above s2 run one after another instead, each with the whole card and SECS of its own (session 54
# lost a call to two s3 arms compiled together on an H100).
arms() {
  local size=$1 secs=$2; shift 2
  local n=$# turn; turn=$(mktemp -d) || return 1
  local gpu_mib; gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  local one_by_one=""
  case $size in s1|s2|tiny) ;; *) [ "$n" -gt 1 ] && [ "${gpu_mib:-0}" -lt 102400 ] && one_by_one=1 ;; esac
  local frac; frac=$(python3 -c "print(round(0.9 / $n, 3))")
  local turn_args=(--turn "$turn:$n")
  [ -n "$one_by_one" ] && frac=0.9 && turn_args=()
  if [ -n "$one_by_one" ]; then
    step "$size 8 x (4 x 4096), one arm after another (${gpu_mib} MiB holds one): $*"
  else
    step "$size 8 x (4 x 4096), compiled at once, timed in turn: $*"
  fi
  local pids=() spec name dir sets
  for spec in "$@"; do
    name=${spec%%:*}; sets=""; [ "$spec" != "$name" ] && sets=${spec#*:}
    dir=$(pwd); case $name in *@*) dir=${name#*@}; name=${name%%@*} ;; esac
    local flags_var="XLA_ARM_$name"; local flags="$XLA_FLAGS ${!flags_var:-}"
    (cd "$dir" && XLA_FLAGS="${flags# }" XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout -s TERM "$secs" python3 -u \
        benchmarks/gpu_step.py --sizes "$size" --batch 4 --seq 4096 --grad_accum 8 --steps 2 \
        --no_split "${turn_args[@]}" --json "$OUT/${size}_$name.json" ${sets:+--set ${sets//,/ }} \
        > "/tmp/arm_${size}_$name.out" 2>&1) & pids+=($!)
    if [ -n "$one_by_one" ]; then wait "${pids[-1]}"; fi
  done
  [ -z "$one_by_one" ] && wait "${pids[@]}"   # by pid: a bare `wait` also waits for the tee above
  for spec in "$@"; do
    name=${spec%%:*}; name=${name%%@*}
    echo "-- $name"; grep -E "^\| $size|rror" "/tmp/arm_${size}_$name.out" | tail -2
    # the arm's whole output comes back too (session 61's four flag arms all hit their timeout and
    # left nothing to say how far each had got)
    cp "/tmp/arm_${size}_$name.out" "$OUT/arm_${size}_$name.out" 2>/dev/null
  done
}
# profile SIZE NAME [KEY=VALUE ...]: gpu_profile.py at 4 x 4096 (command buffers off, two profiled
# steps) until 585 s into the call (PROFILE_ARGS in the environment: more of its flags, e.g.
# "--images" for the model with its ViT on the pipeline's first batch); writes $OUT/prof_NAME.json and $OUT/profile_NAME.txt and prints
# the component table and the last 60 lines.
profile() {
  local size=$1 name=$2; shift 2
  step "profile $size ${PBATCH:-4} x 4096: $name"
  timeout -s TERM $(( 585 - SECONDS )) python3 -u benchmarks/gpu_profile.py --size "$size" \
      --batch "${PBATCH:-4}" --seq 4096 --steps 2 --top 30 --out "/tmp/prof_$name" --json "$OUT/prof_$name.json" \
      $PROFILE_ARGS ${1:+--set "$@"} > "$OUT/profile_$name.txt" 2>&1
  sed -n "/component/,/^$/p" "$OUT/profile_$name.txt"; tail -60 "$OUT/profile_$name.txt"
  # The compiled HLO text (fusion decisions, for reading on the CPU afterwards), gzipped, when it
  # fits what comes back (16 MiB a file).
  local hlo; hlo=$(ls /tmp/prof_$name/*.hlo.txt 2>/dev/null | head -1)
  if [ -n "$hlo" ]; then
    gzip -c "$hlo" > "$OUT/hlo_$name.txt.gz"
    [ "$(stat -c %s "$OUT/hlo_$name.txt.gz")" -lt 16000000 ] || rm -f "$OUT/hlo_$name.txt.gz"
  fi
}
# tree_copy NAME FILE SED: a copy of the tree at /tmp/tree_NAME with FILE edited by SED; fails (and
# says so) when SED changes nothing. Use as an arm's @DIR: arms s3 200 main idx@/tmp/tree_idx
tree_copy() {
  local dir=/tmp/tree_$1 file=$2 expr=$3
  rm -rf "$dir" && mkdir -p "$dir" && cp -a . "$dir"/ && sed -i "$expr" "$dir/$file" || return 1
  if cmp -s "$file" "$dir/$file"; then echo "tree_copy $1: '$expr' changed nothing in $file"; return 1; fi
  diff "$file" "$dir/$file" | head -4
}
# tree_edit NAME SCRIPT: a copy of the tree at /tmp/tree_NAME changed by `python3 SCRIPT DIR` (a
# candidate's text edits, which should stop on a copy its edits no longer match; session 57's
# s57_candidate.py, in git history, is an example); fails when the script does. Use as an arm's @DIR like tree_copy.
tree_edit() {
  local dir=/tmp/tree_$1
  rm -rf "$dir" && mkdir -p "$dir" && cp -a . "$dir"/ && python3 "$2" "$dir"
}
# site_burst [ARGS ...]: the mHC site rows at s3's shapes (reference, registered kernel, rows kernel
# since session 68, -X copy), timed in bursts by mhc_moe_gpu.py (session 64's change), SITE_SECS
# (default 150) of the call; ARGS go to mhc_moe_gpu.py (e.g. --rows-tiles 8x256w8/16x64w8); writes
# $OUT/site.json.
site_burst() {
  local secs=${SITE_SECS:-150}
  step "site: reference, kernel, rows, copy (bursts) $*"
  timeout -s TERM "$secs" python3 -u benchmarks/mhc_moe_gpu.py --only=site --copy --reps 20 \
      --budget-s $(( secs - 30 )) --json="$OUT/site.json" "$@" 2>&1 \
      | grep -v "^WARNING\|DeprecationWarning\|warnings.warn" | grep "^case=\|rror"
}
# faster_site FILE: "rows" when site_burst's FILE has the rows kernel's forward+backward faster than
# the earlier kernel's ("kernel"), else "main" (also when FILE is missing or unreadable).
faster_site() {
  python3 - "$1" <<'PY'
import json, sys
try:
  rows = json.load(open(sys.argv[1]))
  rows = rows if isinstance(rows, list) else rows.get("rows", [])
  t = {r["impl"]: r["ms"] for r in rows if r.get("case") == "mhc site fwd+bwd" and "ms" in r}
  print("rows" if t.get("rows", 1e9) < t.get("kernel", 0) else "main")
except Exception:
  print("main")
PY
}
# rows_tree: a tree copy at /tmp/tree_rows whose dispatcher runs `pallas_kernels.mhc_rows:hc_site` as
# the op hc_site's kernel (session 68; main does since session 69, so this now fails: "changed nothing").
rows_tree() {
  tree_copy rows pallas_kernels/dispatch.py \
      's|Kernel("pallas_kernels.mhc:hc_site",|Kernel("pallas_kernels.mhc_rows:hc_site",|'
}
# earlier_site_tree: a tree copy at /tmp/tree_earlier_site whose dispatcher runs the kernel of hc_site
# registered before session 69 (`pallas_kernels.mhc:hc_site`); an arm's @DIR for main-vs-earlier pairs.
earlier_site_tree() {
  tree_copy earlier_site pallas_kernels/dispatch.py \
      's|Kernel("pallas_kernels.mhc_rows:hc_site",|Kernel("pallas_kernels.mhc:hc_site",|'
}
