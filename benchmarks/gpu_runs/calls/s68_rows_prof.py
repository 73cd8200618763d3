# Session 68 (an H100; run as `PYTHONPATH=$PWD python3 ...` after the prelude's wheels): kernel times of
# the rows site (pallas_kernels/mhc_rows.py) and the registered one, forward+backward at s3's shapes.
import collections, glob
import jax, jax.numpy as jnp, numpy as np
from benchmarks.mhc_moe_gpu import site_inputs, _loss_grad
from pallas_kernels import mhc as mhc_kernel, mhc_rows
KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)
args = site_inputs(np.random.default_rng(0), (4, 4096), 4, 1024, "bfloat16")
for name, f in (("rows", lambda *a: mhc_rows.hc_site(*a, **KW)),
                ("kernel", lambda *a: mhc_kernel.hc_site(*a, **KW))):
  g = _loss_grad(f, args)
  jax.block_until_ready(g(*args))
  d = f"/tmp/tr_{name}"
  with jax.profiler.trace(d):
    for _ in range(5):
      out = g(*args)
    jax.block_until_ready(out)
  from benchmarks.trace_summary import load
  from benchmarks.gpu_profile import gpu_kernels
  tr = sorted(glob.glob(d + "/**/*.trace.json.gz", recursive=True) +
              glob.glob(d + "/**/perfetto_trace.json.gz", recursive=True))
  spans, busy = gpu_kernels(load(tr[-1]))
  by = collections.Counter()
  for e in spans:
    by[str(e.get("args", {}).get("hlo_op", "")) + " " + e.get("name", "")[:50]] += e.get("dur", 0) / 5e3
  print("=====", name, "busy ms/call", busy / 5e3, flush=True)
  for k, v in by.most_common(14):
    print(f"{v:8.4f} ms  {k}", flush=True)
