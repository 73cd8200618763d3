# Session 68 (CPU host): dump the Triton IR of mhc_rows' kernels at s3's widths (d 1024, n 4, 256 tokens) for
# sm_90a register counts. Usage: .venv/bin/python benchmarks/gpu_runs/calls/s68_ptxas_dump.py DIR FWD BWD [bfloat16|float32]
# with FWD/BWD as tokens,channels,warps (e.g. 8,256,8 8,64,4); then s68_ptxas_compile.py on DIR/01.ttir (forward) and
# DIR/03.ttir (backward) in a venv with pip triton==3.6.*.
import sys, os; sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from jax._src.pallas.triton import lowering as L
out_dir = sys.argv[1]; os.makedirs(out_dir, exist_ok=True)
orig = L.lower_jaxpr_to_triton_module
count = [0]
def spy(*a, **k):
  r = orig(*a, **k)
  count[0] += 1
  name = str(a[0].debug_info.func_name) if hasattr(a[0], 'debug_info') else 'k'
  with open(f"{out_dir}/{count[0]:02d}.ttir", "w") as f:
    f.write(r.module.operation.get_asm(enable_debug_info=False))
  return r
L.lower_jaxpr_to_triton_module = spy
from tests.pallas_kernels.cuda_lowering import lower_for_cuda
from benchmarks.mhc_moe_gpu import site_inputs
from pallas_kernels import mhc_rows
KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)
fwd = tuple(int(v) for v in sys.argv[2].split(','))
bwd = tuple(int(v) for v in sys.argv[3].split(','))
args = site_inputs(np.random.default_rng(0), (1, 256), 4, 1024, sys.argv[4] if len(sys.argv) > 4 else "bfloat16")
f = lambda *a: mhc_rows.hc_site(*a, **KW, interpret=False, fwd_tiles=fwd, bwd_tiles=bwd)
def loss(*a): return sum(jnp.sum(o.astype(jnp.float32)) for o in f(*a))
lower_for_cuda(jax.grad(loss, argnums=tuple(range(9))), *args)
print("dumped", count[0])
