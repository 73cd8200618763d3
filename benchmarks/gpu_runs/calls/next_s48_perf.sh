# Next session (issues 26 and 28, ~540 s; carry .whl; from the repository root): s3's accumulated step
# (8 x (4 x 4096); bfloat16 streams and compute-dtype expert products are s3's defaults since
# session 47) side by side with one kernel default changed in a copy of the tree each:
#   main       the indexer scores tile 64 x 128 (session 47: 1.13 ms standalone against 1.49)
#   idx_n64    the old tile, 64 x 64 (does the new one shorten the step?)
#   fwd_bk128  sparse_attend's forward slot block 128 (standalone forward 0.91 ms against 1.05-1.17)
#   run(command="bash benchmarks/gpu_runs/calls/next_s48_perf.sh", carry=[".whl"], timeout_s=600)
# Then ARMS="stages3 bk128_stages3" for the rest (3 stages: forward + backward 2.86 ms against 3.02).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
ROOT=$(pwd)
# variant NAME FILE SED: the step in a copy of the tree with FILE edited by SED (checked to change it)
variant() {
  local name=$1 file=$2 expr=$3 dir=/tmp/variant_$1
  rm -rf "$dir" && mkdir -p "$dir" && cp -a "$ROOT"/. "$dir"/ && cd "$dir" || return 1
  sed -i "$expr" "$file"
  if cmp -s "$file" "$ROOT/$file"; then echo "variant $name: '$expr' changed nothing in $file"; cd "$ROOT"; return 1; fi
  diff "$ROOT/$file" "$file" | head -4
  accum s3 "$name" 170
  cd "$ROOT"
}
SA=pallas_kernels/csa2_attention.py
for arm in ${ARMS:-main idx_n64 fwd_bk128}; do
  case $arm in
    main) accum s3 main 170 ;;
    idx_n64) variant idx_n64 pallas_kernels/indexer.py 's/block_n: int = 128/block_n: int = 64/' ;;
    fwd_bk128) variant fwd_bk128 $SA 's/block_k: int | None = None,/block_k: int | None = 128,/' ;;
    stages3) variant stages3 $SA 's/num_stages: int = 2, fused_probs/num_stages: int = 3, fused_probs/' ;;
    bk128_stages3) variant bk128_stages3 $SA 's/block_k: int | None = None,/block_k: int | None = 128,/; s/num_stages: int = 2, fused_probs/num_stages: int = 3, fused_probs/' ;;
    *) echo "unknown arm $arm" ;;
  esac
done
step done
