"""Pixel-unshuffle and the projector of `dsv41_jax/vision/projector.py` vs float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.vision import projector
from dsv41_jax.vision.config import VisionConfig

@pytest.fixture(autouse=True)
def _highest_matmul_precision():
  """Full-precision products for this module's tests only (a process-wide setting leaked into
  every later test of the same worker)."""
  with jax.default_matmul_precision("highest"):
    yield


def test_pixel_unshuffle_concatenates_the_nine_neighbours_in_row_major_order():
  rng = np.random.default_rng(0)
  G, u, D = 6, 3, 5
  x = rng.normal(size=(2, G * G, D))
  got = np.asarray(projector.pixel_unshuffle(jnp.asarray(x), G, u))
  assert got.shape == (2, 4, 9 * D)
  grid = x.reshape(2, G, G, D)
  for n in range(2):
    for i in range(G // u):
      for j in range(G // u):
        want = np.concatenate([grid[n, u * i + a, u * j + b] for a in range(u) for b in range(u)])
        np.testing.assert_array_equal(got[n, (G // u) * i + j], want.astype(np.float32))


def test_cell_mask():
  m = np.asarray(projector.cell_mask(jnp.asarray([[2, 3], [1, 1]]), 4)).reshape(2, 4, 4)
  assert m[0, :2, :3].all() and m[0].sum() == 6
  assert m[1, 0, 0] and m[1].sum() == 1


def test_projector_equals_float64_reference():
  vc = VisionConfig(num_layers=1, hidden_size=8, num_heads=2, intermediate_size=16,
                    projector_hidden=24, max_image_size=84)
  proj = projector.Projector(vc, 12, nnx.Rngs(0))
  rng = np.random.default_rng(1)
  proj.norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, 72), jnp.float32)
  f = rng.normal(size=(3, 36, 8)).astype(np.float32)          # a 6 × 6 patch grid, 2 × 2 cells
  got = np.asarray(proj(jnp.asarray(f)))
  y = np.asarray(projector.pixel_unshuffle(jnp.asarray(f), 6, 3), np.float64)
  y = y / np.sqrt(np.mean(y ** 2, -1, keepdims=True) + vc.rms_norm_eps) * np.asarray(proj.norm.scale[...])
  a = y @ np.asarray(proj.w1[...], np.float64)
  g = 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))
  want = g @ np.asarray(proj.w2[...], np.float64)
  assert got.shape == (3, 4, 12)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
