# Session 64 (2026-12-07, an H100, main e4c11d9; run as `PYTHONPATH=$PWD python3 ...`); the kernel it times was removed after it.
# The streaming mHC site's forward core at s3's shapes over tiles and warps (one GPU).
import time, jax, jax.numpy as jnp
from pallas_kernels import mhc_stream
B, T, n, d = 4, 4096, 4, 1024
k = jax.random.split(jax.random.key(0), 8)
X = jax.random.normal(k[0], (B, T, n, d), jnp.bfloat16)
F = jax.random.normal(k[1], (B, T, d), jnp.bfloat16)
post = jax.nn.sigmoid(jax.random.normal(k[2], (B, T, n))) * 2
comb = jax.nn.softmax(jax.random.normal(k[3], (B, T, n, n)), -1)
pre = jax.nn.sigmoid(jax.random.normal(k[4], (B, T, n)))
fn = jax.random.normal(k[5], ((2 + n) * n, n * d), jnp.float32) * 0.02
nw = jnp.ones((d,))
import sys
for bt, bd, w in eval(sys.argv[1]) if len(sys.argv) > 1 else ((16, 128, 4), (16, 128, 1), (16, 32, 4), (64, 128, 4), (16, 1024, 8), (128, 64, 4), (32, 128, 8)):
  static = (1e-6, bt, bd, False, w, 1)
  try:
    core = jax.jit(lambda X, F: mhc_stream._forward(X, F, post, comb, pre, fn, static))
    jax.block_until_ready(core(X, F))
    t0 = time.perf_counter(); [jax.block_until_ready(core(X, F)) for _ in range(5)]
    print(f"forward kernel+sum bt={bt} bd={bd} warps={w}: {(time.perf_counter() - t0) / 5 * 1e3:.3f} ms", flush=True)
  except Exception as e:
    print(f"bt={bt} bd={bd} warps={w}: {type(e).__name__} {str(e)[:200]}", flush=True)
