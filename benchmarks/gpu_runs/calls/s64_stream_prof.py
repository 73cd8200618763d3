# Session 64 (2026-12-07, an H100, main e4c11d9; run as `PYTHONPATH=$PWD python3 ...`); the kernel it times was removed after it.
# Kernel times of the streaming mHC site forward and forward+backward at s3's shapes (one H100/H200).
import time, jax, jax.numpy as jnp, numpy as np, subprocess, sys, os
from pallas_kernels import mhc_stream
B,T,n,d = 4,4096,4,1024
k = jax.random.split(jax.random.key(0), 8)
X = jax.random.normal(k[0], (B,T,n,d), jnp.bfloat16)
F = jax.random.normal(k[1], (B,T,d), jnp.bfloat16)
post = jax.nn.sigmoid(jax.random.normal(k[2], (B,T,n)))*2
comb = jax.nn.softmax(jax.random.normal(k[3], (B,T,n,n)), -1)
pre = jax.nn.sigmoid(jax.random.normal(k[4], (B,T,n)))
fn = jax.random.normal(k[5], ((2+n)*n, n*d), jnp.float32)*0.02
base = jnp.zeros(((2+n)*n,)); scale = jnp.ones((3,)); nw = jnp.ones((d,))
kw = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)
f = jax.jit(lambda X,F: mhc_stream.hc_site(X,F,post,comb,pre,fn,base,scale,nw,**kw))
def loss(X,F):
  o = mhc_stream.hc_site(X,F,post,comb,pre,fn,base,scale,nw,**kw)
  return sum(jnp.sum(a.astype(jnp.float32)) for a in o)
g = jax.jit(jax.grad(loss, argnums=(0,1)))
for name, h in (("fwd", f), ("fwd+bwd", g)):
  jax.block_until_ready(h(X,F))
  t0=time.perf_counter(); [jax.block_until_ready(h(X,F)) for _ in range(5)]; print(name, (time.perf_counter()-t0)/5*1e3, "ms", flush=True)
  d_ = f"/tmp/tr_{name.replace('+','_')}"
  with jax.profiler.trace(d_):
    for _ in range(3): jax.block_until_ready(h(X,F))
  print(subprocess.run([sys.executable, "benchmarks/trace_summary.py", d_, "--top", "12"], capture_output=True, text=True).stdout[-3000:], flush=True)
# The pieces: the streaming core alone, then the gates on its mix.
static = (1e-6, 16, 128, False, 4, 1)
core = jax.jit(lambda X, F: mhc_stream._site_core(X, F, post, comb, pre, fn, nw, static))
out = core(X, F); jax.block_until_ready(out)
t0 = time.perf_counter(); [jax.block_until_ready(core(X, F)) for _ in range(5)]
print("core fwd", (time.perf_counter() - t0) / 5 * 1e3, "ms", flush=True)
from pallas_kernels.mhc import coefficients_of_mix
raw, ms = out[2], out[3]
mix = (raw * jax.lax.rsqrt(ms)).reshape(B, T, (2 + n) * n)
for bt in (16, 64, 256):
  gates = jax.jit(lambda m: coefficients_of_mix(m, base, scale, n=n, iters=20, hc_eps=1e-6, block_tokens=bt))
  jax.block_until_ready(gates(mix))
  t0 = time.perf_counter(); [jax.block_until_ready(gates(mix)) for _ in range(5)]
  print("gates fwd block", bt, (time.perf_counter() - t0) / 5 * 1e3, "ms", flush=True)
r = subprocess.run([sys.executable, "benchmarks/trace_summary.py", "/tmp/tr_fwd", "--top", "12"], capture_output=True, text=True)
print(r.stdout[-2500:], r.stderr[-1500:])
