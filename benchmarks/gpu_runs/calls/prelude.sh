# Sourced by each device call of 2026-12-01 (late session): the image's missing wheels, logs to $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
step() { echo; echo "=== $(date +%T) $*"; }
# A size's step at issue 28's setting (8 micro-batches of 4 x 4096) by benchmarks/gpu_step.py:
# accum SIZE NAME SECONDS [KEY=VALUE ...] writes $OUT/SIZE_NAME.json (the KEY=VALUEs go to --set);
# s3_accum NAME SECONDS [KEY=VALUE ...] is `accum s3 ...`.
accum() {
  local size=$1 name=$2 secs=$3; shift 3
  step "$size 8 x (4 x 4096): $name"
  timeout -s TERM "$secs" python3 -u benchmarks/gpu_step.py --sizes "$size" --batch 4 --seq 4096 \
      --grad_accum 8 --steps 2 --no_split --json "$OUT/${size}_$name.json" ${1:+--set "$@"} | tail -4
}
s3_accum() { accum s3 "$@"; }
