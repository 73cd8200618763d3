"""ViT pieces of `dsv41_jax/vision/vit.py` and `rope2d.py` against float64 numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.vision import rope2d, vit
from dsv41_jax.vision.config import VisionConfig

@pytest.fixture(autouse=True)
def _highest_matmul_precision():
  """Full-precision products for this module's tests only (a process-wide setting leaked into
  every later test of the same worker)."""
  with jax.default_matmul_precision("highest"):
    yield

VCFG = VisionConfig(num_layers=2, hidden_size=32, num_heads=4, intermediate_size=48,
                    projector_hidden=40, max_image_size=168, remat=False)


def test_patchify_and_patch_embedding_equal_numpy_loops():
  rng = np.random.default_rng(0)
  p = 14
  pixels = rng.integers(0, 256, (2, 42, 42, 3)).astype(np.uint8)
  w = rng.normal(size=(p * p * 3, 5))
  got_patches = np.asarray(vit.patchify(vit.normalize_pixels(pixels), p))
  x = pixels.astype(np.float64) / 127.5 - 1.0
  want = np.zeros((2, 9, p * p * 3))
  for n in range(2):
    for r in range(3):
      for c in range(3):
        for i in range(p):
          for j in range(p):
            for ch in range(3):
              want[n, 3 * r + c, (p * i + j) * 3 + ch] = x[n, p * r + i, p * c + j, ch]
  np.testing.assert_allclose(got_patches, want, rtol=0, atol=1e-6)
  # The ViT's linear patch embedding is exactly this matrix product.
  model = vit.ViT(VCFG.replace(num_layers=1), nnx.Rngs(0))
  model.patch_embed[...] = jnp.asarray(rng.normal(size=(VCFG.patch_dim, VCFG.hidden_size)),
                                       jnp.float32)
  emb = jnp.einsum("nsp,pd->nsd", vit.patchify(vit.normalize_pixels(pixels), p),
                   model.patch_embed[...])
  w64 = np.asarray(model.patch_embed[...], np.float64)
  # float32 accumulation of 588 products: error bound ~ n·eps32·Σ|x·w| (a few eps per term here)
  bound = 8 * np.finfo(np.float32).eps * (np.abs(want) @ np.abs(w64))
  assert (np.abs(np.asarray(emb) - want @ w64) <= bound).all()


def _rope2d_ref(x, r, c, theta):
  """x [C]: first half rotated by r, second by c, pairs (2i, 2i+1), ω_i = θ^(−2i/(C/2))."""
  C = x.shape[-1]
  half = C // 2
  w = theta ** (-np.arange(0, half, 2) / half)
  out = x.astype(np.float64).copy()
  for base, pos in ((0, r), (half, c)):
    for i, wi in enumerate(w):
      a, b = x[base + 2 * i], x[base + 2 * i + 1]
      ang = pos * wi
      out[base + 2 * i] = a * np.cos(ang) - b * np.sin(ang)
      out[base + 2 * i + 1] = a * np.sin(ang) + b * np.cos(ang)
  return out


def test_rope2d_equals_reference_rotation():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(5, 2, 16)).astype(np.float32)   # [S, H, C]
  rows, cols = rng.integers(0, 30, 5), rng.integers(0, 30, 5)
  inv = rope2d.rope2d_inv_freq(16, 100.0)
  got = np.asarray(rope2d.apply_rope2d(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(cols), inv))
  for s in range(5):
    for h in range(2):
      np.testing.assert_allclose(got[s, h], _rope2d_ref(x[s, h], rows[s], cols[s], 100.0),
                                 rtol=1e-5, atol=1e-5)


def test_rope2d_scores_depend_only_on_relative_offsets():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(1, 1, 32)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 32)), jnp.float32)
  inv = rope2d.rope2d_inv_freq(32, 10000.0)

  def score(rq, cq, rk, ck):
    qq = rope2d.apply_rope2d(q, jnp.asarray([rq]), jnp.asarray([cq]), inv)
    kk = rope2d.apply_rope2d(k, jnp.asarray([rk]), jnp.asarray([ck]), inv)
    return float(jnp.sum(qq * kk))

  for _ in range(6):
    rq, cq, rk, ck = (int(v) for v in rng.integers(0, 40, 4))
    dr, dc = (int(v) for v in rng.integers(-20, 20, 2))
    base = score(rq, cq, rk, ck)
    assert score(rq + dr + 20, cq + dc + 20, rk + dr + 20, ck + dc + 20) == pytest.approx(
        base, rel=1e-4, abs=1e-4)
  # ... and does depend on the offset, in each direction separately
  assert abs(score(3, 3, 3, 3) - score(3, 3, 5, 3)) > 1e-3
  assert abs(score(3, 3, 3, 3) - score(3, 3, 3, 5)) > 1e-3
  assert abs(score(3, 3, 5, 3) - score(3, 3, 3, 5)) > 1e-3   # rows and columns are not mixed


def test_vit_attention_equals_masked_softmax_reference():
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=(2, 6, 2, 8)).astype(np.float32) for _ in range(3))
  mask = np.array([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], bool)   # second image: no real patch
  got = np.asarray(vit.vit_attention(*(jnp.asarray(a) for a in (q, k, v)), jnp.asarray(mask)))
  for n in range(2):
    for h in range(2):
      s = q[n, :, h].astype(np.float64) @ k[n, :, h].T / np.sqrt(8)
      if mask[n].any():
        s = np.where(mask[n][None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
      else:   # no real patch (an empty image slot): finite, uniform weights, never NaN
        p = np.full((6, 6), 1 / 6)
      np.testing.assert_allclose(got[n, :, h], p @ v[n, :, h], rtol=1e-5, atol=1e-5)


def test_patch_mask_marks_the_top_left_cells():
  m = np.asarray(vit.patch_mask(jnp.asarray([[1, 2], [4, 4], [0, 0]]), 12, 3)).reshape(3, 12, 12)
  assert m[0, :3, :6].all() and m[0].sum() == 18
  assert m[1].all()
  assert not m[2].any()


@pytest.fixture(scope="module")
def encoder():
  model = vit.ViT(VCFG, nnx.Rngs(0))
  return nnx.split(model)


def test_image_features_independent_of_padding_canvas_and_batch_neighbours(encoder):
  """An image of 2 × 1 cells alone on an 84-px canvas, or on the 168-px canvas next to another
  image with random padding pixels, gets the same features on its real patches."""
  graphdef, state = encoder
  run = jax.jit(lambda px, cells: nnx.merge(graphdef, state)(px, cells))
  rng = np.random.default_rng(4)
  img = rng.integers(0, 256, (84, 42, 3)).astype(np.uint8)
  small = np.zeros((1, 84, 84, 3), np.uint8)
  small[0, :, :42] = img
  f_small, m_small = run(small, np.array([[2, 1]]))
  big = rng.integers(0, 256, (2, 168, 168, 3)).astype(np.uint8)   # padding is noise
  big[0, :84, :42] = img
  f_big, m_big = run(big, np.array([[2, 1], [3, 4]]))
  real_small = np.asarray(f_small[0])[np.asarray(m_small[0])]
  real_big = np.asarray(f_big[0])[np.asarray(m_big[0])]
  assert real_small.shape == (6 * 3, VCFG.hidden_size)
  np.testing.assert_allclose(real_big, real_small, rtol=1e-4, atol=1e-5)


def test_vit_rejects_non_rgb_canvases(encoder):
  graphdef, state = encoder
  with pytest.raises(ValueError, match=r"square RGB"):
    nnx.merge(graphdef, state)(np.zeros((1, 42, 42, 4), np.uint8), np.array([[1, 1]]))


def test_config_validation_names_fields():
  from dsv41_jax.config import ConfigError
  with pytest.raises(ConfigError, match="max_image_size"):
    VisionConfig(max_image_size=1000)
  with pytest.raises(ConfigError, match="num_heads"):
    VisionConfig(hidden_size=100, num_heads=16)
  with pytest.raises(ConfigError, match="multiple of 4"):
    VisionConfig(hidden_size=96, num_heads=16)


def test_nested_vision_section_of_the_config_tree():
  from configs import common, tiny
  cfg = tiny.get_config()
  cfg.model.vision.num_layers = 3            # a command-line override lands here
  mc = common.model_config(cfg)
  assert isinstance(mc.vision, VisionConfig) and mc.vision.num_layers == 3
  assert mc.vision.hidden_size == 64 and mc.vision.patch_size == 14   # the rest: tiny / defaults
  assert tuple(cfg.optim.frozen) == ("vision/**",) and cfg.optim.unfreeze_at == "decay_start"
  with pytest.raises(KeyError, match=r"config.model.vision has unknown keys \['depth'\]"):
    common.base_config(model={"vision": {"depth": 3}})
