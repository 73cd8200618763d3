"""benchmarks/flop_audit.py's count of matrix-product FLOPs in a jaxpr, against hand counts."""

import collections

import jax
import jax.numpy as jnp

from benchmarks import flop_audit


def _count(fn, *args):
  rows = collections.defaultdict(lambda: [0.0, 0.0])
  kernels, unknown = collections.Counter(), collections.Counter()
  flop_audit.walk(jax.make_jaxpr(fn)(*args).jaxpr, 1.0, rows, kernels, unknown)
  return sum(f for f, _ in rows.values()), sum(n for _, n in rows.values()), unknown


def test_loops_multiply_and_the_backward_counts_its_products():
  x = jnp.ones((8, 16), jnp.float32)
  w = jnp.ones((5, 16, 16), jnp.float32)
  one = 2.0 * 8 * 16 * 16                       # one [8, 16] x [16, 16] product

  def scanned(x, w):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

  flops, runs, unknown = _count(scanned, x, w)
  assert (flops, runs, unknown) == (5 * one, 5, {})

  def looped(x, w):                             # fori_loop with static bounds: a scan
    return jax.lax.fori_loop(0, 3, lambda i, h: h @ w[i], x, unroll=2)

  flops, runs, _ = _count(looped, x, w)
  assert (flops, runs) == (3 * one, 3)

  def counted(x, w):                            # a while counting to a constant
    body = lambda c: (c[0] + 1, c[1] @ w[c[0]])
    return jax.lax.while_loop(lambda c: c[0] < 4, body, (1, x))[1]

  flops, runs, unknown = _count(counted, x, w)
  assert (flops, runs, unknown) == (3 * one, 3, {})

  def dynamic(x, w, n):                         # a while without a constant trip count: once
    return jax.lax.fori_loop(0, n, lambda i, h: h @ w[i], x)

  flops, runs, unknown = _count(dynamic, x, w, 3)
  assert (flops, runs) == (one, 1) and sum(unknown.values()) == 1

  # value and gradient of sum(tanh(x @ w0) @ w1) over both weights: 2 forward products, and in the
  # backward 2 weight gradients and 1 input gradient (x's is not asked for)
  grad = jax.grad(lambda ws, x: jnp.sum(jnp.tanh(x @ ws[0]) @ ws[1]))
  flops, runs, _ = _count(grad, w[:2], x)
  assert (flops, runs) == (5 * one, 5)


def test_ragged_products_count_each_row_once():
  x = jnp.ones((12, 16), jnp.float32)
  w = jnp.ones((3, 16, 8), jnp.float32)
  sizes = jnp.array([4, 0, 8], jnp.int32)
  flops, runs, _ = _count(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
  assert (flops, runs) == (2.0 * 12 * 16 * 8, 1)
  # the weight gradient contracts the ragged rows ([G, K, N] out, each row used once); the
  # jaxpr of the gradient also holds the forward product (XLA drops it: its value is unused)
  g = jax.grad(lambda w, x: jnp.sum(jax.lax.ragged_dot(x, w, sizes)))
  flops, runs, _ = _count(g, w, x)
  assert (flops, runs) == (2 * 2.0 * 12 * 16 * 8, 2)
