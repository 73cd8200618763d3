"""The SigLIP stage (`dsv41_jax/vision/siglip.py`, `launch/vit_pretrain.py`): the sigmoid loss
against a float64 loop, and the ViT checkpoint the LM starts from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import model as M
from dsv41_jax.vision import siglip
from tests.dsv41_jax.vision.test_pathway import micro_config


def test_sigmoid_loss_equals_float64_loop():
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
  t, b = 1.7, -3.2
  got = float(siglip.sigmoid_loss(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32),
                                  jnp.float32(t), jnp.float32(b)))
  xn = x / np.linalg.norm(x, axis=1, keepdims=True)
  yn = y / np.linalg.norm(y, axis=1, keepdims=True)
  total = 0.0
  for i in range(5):
    for j in range(5):
      z = 1.0 if i == j else -1.0
      total -= np.log(1.0 / (1.0 + np.exp(-z * (np.exp(t) * xn[i] @ yn[j] + b))))
  assert got == pytest.approx(total / 5, rel=1e-5)


def test_towers_pool_only_real_patches_and_tokens():
  cfg = micro_config()
  model = siglip.SigLIP(cfg.vision, 50, nnx.Rngs(0), embed_dim=8, text_width=16, text_layers=1,
                        text_heads=2, text_mlp=16)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 50, (2, 6))
  mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
  other = tokens.copy()
  other[0, 3:] = rng.integers(0, 50, 3)                  # change only the padding of caption 0
  a = np.asarray(model.embed_texts(jnp.asarray(tokens), jnp.asarray(mask)))
  b = np.asarray(model.embed_texts(jnp.asarray(other), jnp.asarray(mask)))
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  px = rng.integers(0, 256, (1, 84, 84, 3)).astype(np.uint8)
  px2 = px.copy()
  px2[0, 42:] = 0                                        # padding below a 1 × 2-cell image
  e1 = model.embed_images(jnp.asarray(px), jnp.asarray([[1, 2]]))
  e2 = model.embed_images(jnp.asarray(px2), jnp.asarray([[1, 2]]))
  np.testing.assert_allclose(np.asarray(e1), np.asarray(e2), rtol=1e-5, atol=1e-6)


def test_vit_checkpoint_round_trip_into_the_lm(tmp_path):
  from launch import vit_pretrain
  cfg = micro_config()
  sig = siglip.SigLIP(cfg.vision, 50, nnx.Rngs(3), embed_dim=8, text_width=16, text_layers=1,
                      text_heads=2, text_mlp=16)
  path = vit_pretrain.save_vit(sig.vision, str(tmp_path / "vit"), cfg.vision)
  lm = M.Transformer(cfg, nnx.Rngs(0))
  before_proj = jax.tree.map(np.asarray, nnx.state(lm.projector))
  vit_pretrain.load_vit(lm, path)
  want = nnx.state(sig.vision, nnx.Param)
  got = nnx.state(lm.vision, nnx.Param)
  for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(p))
  for a, b in zip(jax.tree.leaves(before_proj), jax.tree.leaves(nnx.state(lm.projector))):
    np.testing.assert_array_equal(np.asarray(b), a)       # only the ViT is replaced
  wrong = micro_config().replace(vision=cfg.vision.replace(hidden_size=32))
  with pytest.raises(ValueError, match="vision config"):
    vit_pretrain.load_vit(M.Transformer(wrong, nnx.Rngs(0)), path)
