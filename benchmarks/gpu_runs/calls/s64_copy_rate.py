# Session 64 (2026-12-07, an H100; run inline as `python3 - <<EOF`): the card's copy rate, −X timed as 30
# calls dispatched back to back and one wait, read + write bytes counted.
import time

import jax
import jax.numpy as jnp


def t(f, x, n=30):
  y = f(x)
  y.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(n):
    y = f(x)
  y.block_until_ready()
  return (time.perf_counter() - t0) / n


neg = jax.jit(lambda x: -x)
for shape, dt in [((4, 4096, 4, 1024), jnp.bfloat16), ((4, 4096, 4, 1024), jnp.float32),
                  ((1 << 28,), jnp.bfloat16), ((1 << 28,), jnp.float32)]:
  x = jnp.ones(shape, dt)
  b = x.size * x.dtype.itemsize * 2
  s = t(neg, x)
  print(shape, jnp.dtype(dt).name, f"{s * 1e3:.4f} ms {b / s / 1e9:.1f} GB/s (read+write)", flush=True)
