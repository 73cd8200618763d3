import numpy as np
import jax.numpy as jnp

from dsv41_jax.layers import rope


def _np_rope(x, pos, inv, sign=1.0):
  x = x.astype(np.float64).copy()
  r = 2 * len(inv)
  for idx in np.ndindex(*x.shape[:-1]):
    p = pos[idx[: pos.ndim]]
    for i, w in enumerate(inv):
      a, b = x[idx + (x.shape[-1] - r + 2 * i,)], x[idx + (x.shape[-1] - r + 2 * i + 1,)]
      c, s = np.cos(sign * p * w), np.sin(sign * p * w)
      x[idx + (x.shape[-1] - r + 2 * i,)] = a * c - b * s
      x[idx + (x.shape[-1] - r + 2 * i + 1,)] = a * s + b * c
  return x


def test_rope_matches_loop_and_inverts():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 12)).astype(np.float32)
  pos = rng.integers(0, 1000, size=(2, 5))
  inv = rope.rope_inv_freq(8, 160000.0)
  got = np.asarray(rope.apply_rope(jnp.asarray(x), jnp.asarray(pos), inv))
  np.testing.assert_allclose(got, _np_rope(x, pos, inv), rtol=2e-5, atol=2e-4)
  back = rope.apply_rope(jnp.asarray(got), jnp.asarray(pos), inv, inverse=True)
  np.testing.assert_allclose(np.asarray(back), x, rtol=1e-5, atol=3e-4)
  np.testing.assert_array_equal(got[..., :4], x[..., :4])  # leading "nope" dims untouched


def test_relative_positions():
  rng = np.random.default_rng(1)
  q, k = rng.standard_normal((2, 16)).astype(np.float32)
  inv = rope.rope_inv_freq(16, 10000.0)
  def score(pq, pk):
    a = rope.apply_rope(jnp.asarray(q)[None], jnp.asarray([pq]), inv)
    b = rope.apply_rope(jnp.asarray(k)[None], jnp.asarray([pk]), inv)
    return float((a * b).sum())
  assert abs(score(7, 3) - score(107, 103)) < 1e-4


def test_yarn_blend_endpoints():
  inv = rope.rope_inv_freq(64, 160000.0)
  yarn = rope.rope_inv_freq(64, 160000.0, yarn=True, factor=16.0, original_max_position=65536,
                            beta_fast=32.0, beta_slow=1.0)
  # Fast (high-frequency) dims keep their frequency, slow dims are interpolated by the factor.
  assert yarn[0] == inv[0]
  np.testing.assert_allclose(yarn[-1], inv[-1] / 16.0, rtol=1e-12)
  assert np.all(yarn <= inv + 1e-18) and np.all(yarn >= inv / 16.0 - 1e-18)
