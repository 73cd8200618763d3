"""Contrastive ViT pre-training with the sigmoid loss (docs/design.md §15.3:
SigLIP's sigmoid loss on image–text pairs, before the ViT joins the LM).

Image tower: the LM's own `ViT` (parameters under `vision/`, the same paths the LM loads), its
features mean-pooled over each image's real patches, then `image_proj` [D_vit, E].
Text tower (small, discarded after the stage): token embedding, `EncoderLayer`s of `vit.py`
without a causal mask (keys masked to the caption's real tokens; RoPE with row 0 and column =
token index, i.e. 1-D RoPE on the second half of each head), RMSNorm, mean-pool over real
tokens, `text_proj` [D_text, E].

With x_i, y_j the L2-normalised image and text embeddings of a batch of N pairs, t = exp(t′) and
b learnt scalars (init t′ = log 10, b = −10, as in SigLIP), z_ij = 1 if i = j else −1:

  L = −(1/N) Σ_i Σ_j log σ(z_ij · (t · x_i·y_j + b))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.layers.norm import RMSNorm
from dsv41_jax.vision.config import VisionConfig
from dsv41_jax.vision.vit import ViT, run_layers, stacked_layers


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def sigmoid_loss(img_NxE: jax.Array, txt_NxE: jax.Array, t_prime: jax.Array, b: jax.Array
                 ) -> jax.Array:
  """The pairwise sigmoid loss above (float32)."""
  x, y = l2_normalize(img_NxE), l2_normalize(txt_NxE)
  logits = jnp.exp(t_prime) * (x @ y.T) + b
  z = 2.0 * jnp.eye(x.shape[0], dtype=jnp.float32) - 1.0
  return -jnp.sum(jax.nn.log_sigmoid(z * logits)) / x.shape[0]


def masked_mean(x_NxSxD: jax.Array, mask_NxS: jax.Array) -> jax.Array:
  m = mask_NxS.astype(jnp.float32)[..., None]
  return jnp.sum(x_NxSxD.astype(jnp.float32) * m, 1) / jnp.maximum(jnp.sum(m, 1), 1.0)


class TextTower(nnx.Module):
  """`embed` [vocab, W], `layers` (stacked EncoderLayers), `final_norm`, `text_proj` [W, E]."""

  def __init__(self, vocab: int, width: int, layers: int, heads: int, mlp: int, out: int,
               rngs: nnx.Rngs, eps: float = 1e-6):
    self.embed = sharding.param(rngs, (vocab, width), ("vocab", "vit_embed"), sharding.normal(1.0))
    self.layers = stacked_layers(layers, rngs, width=width, heads=heads, hidden=mlp, eps=eps,
                                 theta=10000.0, param_dtype=jnp.float32)
    self.final_norm = RMSNorm(width, eps, rngs)
    self.text_proj = sharding.param(rngs, (width, out), ("vit_embed", None),
                                    sharding.fan_in_normal((0,)))

  def __call__(self, tokens_NxL: jax.Array, mask_NxL: jax.Array) -> jax.Array:
    N, L = tokens_NxL.shape
    h = jnp.take(self.embed[...], tokens_NxL, axis=0)
    cols = jnp.broadcast_to(jnp.arange(L)[None], (N, L))
    h = run_layers(self.layers, h, jnp.zeros_like(cols), cols, mask_NxL, scan=True, remat=False)
    return masked_mean(self.final_norm(h), mask_NxL) @ self.text_proj[...]


class SigLIP(nnx.Module):
  """The two towers and the loss's scalars; `vision` is a ViT with the LM's parameter paths."""

  def __init__(self, vcfg: VisionConfig, vocab: int, rngs: nnx.Rngs, *, embed_dim: int = 64,
               text_width: int = 64, text_layers: int = 2, text_heads: int = 4,
               text_mlp: int = 128):
    self.vision = ViT(vcfg, rngs)
    self.image_proj = sharding.param(rngs, (vcfg.hidden_size, embed_dim), ("vit_embed", None),
                                     sharding.fan_in_normal((0,)))
    self.text = TextTower(vocab, text_width, text_layers, text_heads, text_mlp, embed_dim, rngs)
    self.logit_scale = sharding.param(rngs, (), (), sharding.constant(math.log(10.0)))
    self.logit_bias = sharding.param(rngs, (), (), sharding.constant(-10.0))

  def embed_images(self, pixels_NxPxPx3, cells_Nx2) -> jax.Array:
    f, mask = self.vision(pixels_NxPxPx3, cells_Nx2)
    return masked_mean(f, mask) @ self.image_proj[...]

  def embed_texts(self, tokens_NxL, mask_NxL) -> jax.Array:
    return self.text(tokens_NxL, mask_NxL)

  def __call__(self, pixels, cells, tokens, text_mask) -> jax.Array:
    """The sigmoid loss of a batch of N aligned pairs."""
    return sigmoid_loss(self.embed_images(pixels, cells), self.embed_texts(tokens, text_mask),
                        self.logit_scale[...], self.logit_bias[...])
