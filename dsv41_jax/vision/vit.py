"""The DeepSeek-ViT encoder (docs/design.md §15.1).

Changes from a classic ViT, as the report lists them: the patch-embedding convolution is a linear
projection (a plain matrix, so Muon can train it), 2-D RoPE replaces absolute position embeddings
(any resolution), RMSNorm and SwiGLU throughout.

Shapes: N images, P pixels a side of the padded canvas, p = patch_size, G = P / p patches a side,
S = G² patches, C = 3, D = ViT width, H heads, hd = D / H, F = SwiGLU width.

  x        = pixel / 127.5 − 1                                      [N, P, P, 3] uint8 → float
  patches  = x[n, p·r + i, p·c + j, ch] → patches[n, G·r + c, (p·i + j)·3 + ch]     [N, S, p²·3]
  h        = patches @ patch_embed                                  [N, S, p²·3] → [N, S, D]
  per layer (pre-norm):
    a      = RMSNorm(h);  q, k, v = a @ wq, a @ wk, a @ wv          [N, S, D] → [N, S, H, hd]
    q, k   = RoPE2d(q, (r, c)), RoPE2d(k, (r, c))                   (rope2d.py)
    o      = softmax(q·kᵀ / √hd  masked to real keys) · v           [N, H, S, S] scores, float32
    h      = h + o @ wo
    h      = h + (silu(b @ w1) ⊙ (b @ w3)) @ w2,  b = RMSNorm(h)    [N, S, F] → [N, S, D]
  out      = RMSNorm(h)                                             [N, S, D]

Images of different sizes share a batch: each image is top-left aligned on the canvas (the data
pipeline's layout) and its real patches are those with r < 3·h_cells and c < 3·w_cells. Every image
is its own attention sequence, and keys outside the real patches are masked, so an image attends
only among its own real patches; outputs at padding patches are computed but never used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.layers.norm import RMSNorm
from dsv41_jax.vision.config import VisionConfig
from dsv41_jax.vision.rope2d import apply_rope2d, grid_positions, rope2d_inv_freq

# Score of a masked key: finite, so an image slot with no real patch (an empty slot) gives a uniform
# softmax instead of NaN.
MASKED_SCORE = -1e30


def normalize_pixels(pixels: jax.Array) -> jax.Array:
  """uint8 pixels → float32 in [−1, 1]."""
  return pixels.astype(jnp.float32) / 127.5 - 1.0


def patchify(x_NxPxQxC: jax.Array, patch: int) -> jax.Array:
  """Non-overlapping patches, row-major: [N, P, Q, C] → [N, (P/p)·(Q/p), p·p·C] (see module doc)."""
  N, P, Q, C = x_NxPxQxC.shape
  if P % patch or Q % patch:
    raise ValueError(f"image canvas {P}×{Q} is not a whole number of {patch}-px patches")
  x = x_NxPxQxC.reshape(N, P // patch, patch, Q // patch, patch, C)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(N, (P // patch) * (Q // patch), patch * patch * C)


def patch_mask(cells_Nx2: jax.Array, grid: int, unshuffle: int) -> jax.Array:
  """bool [N, grid²]: patch (r, c) is real iff r < unshuffle·h_cells and c < unshuffle·w_cells."""
  rows, cols = grid_positions(grid, grid)
  h = cells_Nx2[:, 0:1] * unshuffle
  w = cells_Nx2[:, 1:2] * unshuffle
  return (jnp.asarray(rows)[None] < h) & (jnp.asarray(cols)[None] < w)


def vit_attention(q_NxSxHxD: jax.Array, k_NxSxHxD: jax.Array, v_NxSxHxD: jax.Array,
                  key_mask_NxS: jax.Array) -> jax.Array:
  """softmax(q·kᵀ/√hd, keys masked) · v per image and head; scores in float32, out in q's dtype."""
  scale = 1.0 / np.sqrt(q_NxSxHxD.shape[-1])
  s = jnp.einsum("nshd,nthd->nhst", q_NxSxHxD, k_NxSxHxD,
                 preferred_element_type=jnp.float32) * scale
  s = jnp.where(key_mask_NxS[:, None, None, :], s, MASKED_SCORE)
  p = jax.nn.softmax(s, axis=-1).astype(v_NxSxHxD.dtype)
  return jnp.einsum("nhst,nthd->nshd", p, v_NxSxHxD, preferred_element_type=jnp.float32
                    ).astype(q_NxSxHxD.dtype)


class Attention(nnx.Module):
  """Multi-head self-attention with 2-D RoPE: wq, wk, wv [D, D], wo [D, D] (heads flattened)."""

  def __init__(self, width: int, heads: int, theta: float, rngs: nnx.Rngs, param_dtype):
    self.heads, self.theta = heads, theta
    init = sharding.fan_in_normal((0,))
    self.wq = sharding.param(rngs, (width, width), ("vit_embed", "vit_heads"), init, param_dtype)
    self.wk = sharding.param(rngs, (width, width), ("vit_embed", "vit_heads"), init, param_dtype)
    self.wv = sharding.param(rngs, (width, width), ("vit_embed", "vit_heads"), init, param_dtype)
    self.wo = sharding.param(rngs, (width, width), ("vit_heads", "vit_embed"), init, param_dtype)

  def __call__(self, x_NxSxD, rows_NxS, cols_NxS, key_mask_NxS):
    N, S, D = x_NxSxD.shape
    dt = x_NxSxD.dtype

    def heads(w):
      y = jnp.einsum("nsd,de->nse", x_NxSxD, w[...].astype(dt))
      return y.reshape(N, S, self.heads, D // self.heads)

    inv_freq = rope2d_inv_freq(D // self.heads, self.theta)
    q = apply_rope2d(heads(self.wq), rows_NxS, cols_NxS, inv_freq)
    k = apply_rope2d(heads(self.wk), rows_NxS, cols_NxS, inv_freq)
    o = vit_attention(q, k, heads(self.wv), key_mask_NxS).reshape(N, S, D)
    return jnp.einsum("nse,ed->nsd", o, self.wo[...].astype(dt))


class SwiGLU(nnx.Module):
  """(silu(x @ w1) ⊙ (x @ w3)) @ w2; w1, w3 [D, F], w2 [F, D]."""

  def __init__(self, width: int, hidden: int, rngs: nnx.Rngs, param_dtype):
    init = sharding.fan_in_normal((0,))
    self.w1 = sharding.param(rngs, (width, hidden), ("vit_embed", "vit_mlp"), init, param_dtype)
    self.w3 = sharding.param(rngs, (width, hidden), ("vit_embed", "vit_mlp"), init, param_dtype)
    self.w2 = sharding.param(rngs, (hidden, width), ("vit_mlp", "vit_embed"), init, param_dtype)

  def __call__(self, x):
    dt = x.dtype
    a = jnp.einsum("nsd,df->nsf", x, self.w1[...].astype(dt))
    u = jnp.einsum("nsd,df->nsf", x, self.w3[...].astype(dt))
    return jnp.einsum("nsf,fd->nsd", jax.nn.silu(a) * u, self.w2[...].astype(dt))


class EncoderLayer(nnx.Module):
  """Pre-norm block: h + Attn(RMSNorm(h)), then h + SwiGLU(RMSNorm(h))."""

  def __init__(self, width: int, heads: int, hidden: int, eps: float, theta: float,
               rngs: nnx.Rngs, param_dtype):
    self.attn_norm = RMSNorm(width, eps, rngs, param_dtype)
    self.attn = Attention(width, heads, theta, rngs, param_dtype)
    self.mlp_norm = RMSNorm(width, eps, rngs, param_dtype)
    self.mlp = SwiGLU(width, hidden, rngs, param_dtype)

  def __call__(self, h, rows, cols, key_mask):
    h = h + self.attn(self.attn_norm(h), rows, cols, key_mask)
    return h + self.mlp(self.mlp_norm(h))


def stacked_layers(n: int, rngs: nnx.Rngs, **kw) -> EncoderLayer:
  """`n` EncoderLayers with parameters stacked on a leading axis."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(r: nnx.Rngs) -> EncoderLayer:
    return EncoderLayer(rngs=r, **kw)

  return make(rngs)


def run_layers(layers: EncoderLayer, h, rows, cols, key_mask, *, scan: bool, remat: bool):
  """Apply the stacked layers in order (one `lax.scan`, or unrolled)."""
  graphdef, params = nnx.split(layers)

  def body(x, p):
    return nnx.merge(graphdef, p)(x, rows, cols, key_mask), None

  if remat:
    body = jax.checkpoint(body, prevent_cse=False)
  if scan:
    return jax.lax.scan(body, h, params)[0]
  n = jax.tree.leaves(params)[0].shape[0]
  for i in range(n):
    h, _ = body(h, jax.tree.map(lambda a: a[i], params))
  return h


class ViT(nnx.Module):
  """Patch embedding → `num_layers` encoder layers → RMSNorm (module docstring)."""

  def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs, *, dtype="float32",
               param_dtype="float32"):
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    pd = jnp.dtype(param_dtype)
    self.patch_embed = sharding.param(rngs, (cfg.patch_dim, cfg.hidden_size),
                                      ("patch", "vit_embed"), sharding.fan_in_normal((0,)), pd)
    self.layers = stacked_layers(
        cfg.num_layers, rngs, width=cfg.hidden_size, heads=cfg.num_heads,
        hidden=cfg.intermediate_size, eps=cfg.rms_norm_eps, theta=cfg.rope_theta, param_dtype=pd)
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs, pd)

  def __call__(self, pixels_NxPxPx3: jax.Array, cells_Nx2: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Features [N, G², D] (G = P / patch_size, row-major patch grid) and the real-patch mask."""
    cfg = self.cfg
    N, P, Q, C = pixels_NxPxPx3.shape
    if P != Q or C != 3:
      raise ValueError(f"ViT input must be square RGB canvases [N, P, P, 3] (got {pixels_NxPxPx3.shape})")
    grid = P // cfg.patch_size
    patches = patchify(normalize_pixels(pixels_NxPxPx3), cfg.patch_size).astype(self.dtype)
    h = jnp.einsum("nsp,pd->nsd", patches, self.patch_embed[...].astype(self.dtype))
    rows, cols = (jnp.asarray(a)[None] for a in grid_positions(grid, grid))
    mask = patch_mask(cells_Nx2, grid, cfg.unshuffle)
    h = run_layers(self.layers, h, rows, cols, mask, scan=cfg.scan_layers, remat=cfg.remat)
    return self.final_norm(h), mask
