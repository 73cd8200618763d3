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


def _concat_form(x, positions, inv_freq, inverse=False):
  """The slice-and-concatenate form apply_rope had until session 57 (the same arithmetic)."""
  r = 2 * len(inv_freq)
  pos = positions.astype(jnp.float32)
  while pos.ndim < x.ndim - 1:
    pos = pos[..., None]
  angle = pos[..., None] * jnp.asarray(inv_freq, jnp.float32)
  angle = -angle if inverse else angle
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  rot = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
  a, b = rot[..., 0], rot[..., 1]
  out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], r)
  return jnp.concatenate([x[..., :-r], out.astype(x.dtype)], axis=-1)


def test_full_width_form_equals_the_concatenation_bit_for_bit():
  # The select-and-swap form (one elementwise pass) against the form it replaced: values and
  # gradients bit for bit, with a head axis and without, bfloat16 and float32, both directions,
  # ±0.0 and large values among the passed-through channels; all channels rotated too.
  import jax
  rng = np.random.default_rng(7)
  for shape, r, dtype, inverse in [((2, 9, 3, 16), 8, jnp.bfloat16, False),
                                   ((2, 9, 3, 16), 8, jnp.float32, True),
                                   ((3, 11, 12), 4, jnp.bfloat16, True),
                                   ((3, 11, 12), 12, jnp.float32, False)]:
    x = rng.standard_normal(shape).astype(np.float32) * 3
    x[..., 0] = -0.0
    x[..., 1] = 1e30
    x = jnp.asarray(x).astype(dtype)
    pos = jnp.asarray(rng.integers(0, 70000, size=shape[:2]))
    inv = rope.rope_inv_freq(r, 160000.0)
    got = rope.apply_rope(x, pos, inv, inverse=inverse)
    want = _concat_form(x, pos, inv, inverse)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)).view(np.uint32),
                                  np.asarray(want.astype(jnp.float32)).view(np.uint32))
    g = jnp.asarray(rng.standard_normal(shape), dtype)
    vjp = lambda f: jax.vjp(lambda v: f(v, pos, inv, inverse=inverse) if f is rope.apply_rope
                            else f(v, pos, inv, inverse), x)[1](g)[0]
    np.testing.assert_array_equal(np.asarray(vjp(rope.apply_rope).astype(jnp.float32)),
                                  np.asarray(vjp(_concat_form).astype(jnp.float32)))
