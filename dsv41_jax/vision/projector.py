"""Pixel-unshuffle and the MLP projector from ViT features to LM tokens (docs/design.md §15.2:
a 3 × 3 pixel-unshuffle cuts the token count ninefold, then a 2-layer MLP with
hidden 5120 maps to the LM width).

Shapes: N images, G patches a side (G = u·Gc), Gc cells a side, u = unshuffle (3), D ViT width,
F projector hidden, d LM width.

  unshuffle:  y[n, Gc·i + j, (u·a + b)·D + e] = x[n, G·(u·i + a) + (u·j + b), e]
              [N, G², D] → [N, Gc², u²·D]     (the u × u neighbours of cell (i, j), row-major)
  project:    z = gelu(RMSNorm(y) @ w1) @ w2  [N, Gc², u²·D] → [N, Gc², F] → [N, Gc², d]

GELU is the tanh approximation. The norm puts the concatenated ViT features on a fixed scale
before the first matrix; neither matrix has a bias (both are plain Muon matrices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.layers.norm import RMSNorm
from dsv41_jax.vision.config import VisionConfig


def pixel_unshuffle(x_NxSxD: jax.Array, grid: int, u: int) -> jax.Array:
  """[N, grid², D] row-major patch features → [N, (grid/u)², u²·D] (module docstring)."""
  N, S, D = x_NxSxD.shape
  if S != grid * grid or grid % u:
    raise ValueError(f"{S} patches are not a {grid}×{grid} grid divisible into {u}×{u} cells")
  gc = grid // u
  x = x_NxSxD.reshape(N, gc, u, gc, u, D).transpose(0, 1, 3, 2, 4, 5)   # n, i, j, a, b, e
  return x.reshape(N, gc * gc, u * u * D)


def cell_mask(cells_Nx2: jax.Array, grid_cells: int) -> jax.Array:
  """bool [N, Gc²]: cell (i, j) belongs to the image iff i < h_cells and j < w_cells."""
  i = jnp.arange(grid_cells)[:, None]
  j = jnp.arange(grid_cells)[None, :]
  m = (i[None] < cells_Nx2[:, 0, None, None]) & (j[None] < cells_Nx2[:, 1, None, None])
  return m.reshape(cells_Nx2.shape[0], grid_cells * grid_cells)


class Projector(nnx.Module):
  """`norm/scale` [u²·D], `w1` [u²·D, F], `w2` [F, d]."""

  def __init__(self, cfg: VisionConfig, lm_width: int, rngs: nnx.Rngs, *, dtype="float32",
               param_dtype="float32"):
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    pd = jnp.dtype(param_dtype)
    d_in = cfg.unshuffle ** 2 * cfg.hidden_size
    self.norm = RMSNorm(d_in, cfg.rms_norm_eps, rngs, pd)
    self.w1 = sharding.param(rngs, (d_in, cfg.projector_hidden), ("proj_in", "proj_mlp"),
                             sharding.fan_in_normal((0,)), pd)
    self.w2 = sharding.param(rngs, (cfg.projector_hidden, lm_width), ("proj_mlp", "embed"),
                             sharding.fan_in_normal((0,)), pd)

  def __call__(self, features_NxSxD: jax.Array) -> jax.Array:
    """ViT features on the G×G patch grid → LM embeddings [N, Gc², d] on the Gc×Gc cell grid."""
    grid = int(round(features_NxSxD.shape[1] ** 0.5))
    y = pixel_unshuffle(features_NxSxD.astype(self.dtype), grid, self.cfg.unshuffle)
    y = self.norm(y)
    h = jax.nn.gelu(jnp.einsum("nsc,cf->nsf", y, self.w1[...].astype(self.dtype)), approximate=True)
    return jnp.einsum("nsf,fd->nsd", h, self.w2[...].astype(self.dtype))
