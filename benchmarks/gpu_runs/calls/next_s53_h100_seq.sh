# Session 53 on an H100 (80 GB: two s3 arms do not pair): s3 8 x (4 x 4096) arms one after another
# (prelude `accum`), each in its own process; ORDER picks them (default: main split dsfusion region).
source benchmarks/gpu_runs/calls/prelude.sh
OUT=$(realpath "$OUT")
# split: the tree before session 53 plus s52_engram_split.patch (on main since session 53, so the
# patch no longer applies to main: the arm is for trees from before that merge only).
case " ${ORDER:-main split dsfusion region} " in *" split "*)
  rm -rf /tmp/tree_split && mkdir -p /tmp/tree_split && cp -a . /tmp/tree_split/ \
    && patch -s -d /tmp/tree_split -p1 < benchmarks/gpu_runs/calls/s52_engram_split.patch || exit 1 ;;
esac
base=$XLA_FLAGS
for arm in ${ORDER:-main split dsfusion region}; do
  left=$(( ${LIMIT:-580} - SECONDS )); [ $left -gt 100 ] || { echo "no time for $arm"; break; }
  case $arm in
    split) (cd /tmp/tree_split && OUT=$OUT accum s3 split $left) ;;
    dsfusion) XLA_FLAGS="$base --xla_gpu_enable_dynamic_slice_fusion=true" accum s3 dsfusion $left ;;
    region) XLA_FLAGS="$base --xla_gpu_copy_insertion_use_region_analysis=true" accum s3 region $left ;;
    *) accum s3 $arm $left ;;
  esac
done
step done
