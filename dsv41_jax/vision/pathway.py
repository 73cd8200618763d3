"""The vision pathway end to end: pixels → ViT → pixel-unshuffle + projector → placeholder spans
(docs/design.md §15; §T2 for the freeze).

  f, _   = ViT(images.reshape(B·M, P, P, 3), cells)          [B·M, G², D_vit]
  f      = stop_gradient(f and the ViT weights)              while the ViT is frozen
  e      = Projector(f)                                      [B·M, Gc², d] → [B, M, Gc², d]
  h      = merge_image_embeddings(token embeddings, e, ...)  [B, T, d]

Frozen means no gradient is computed for the ViT at all: its weights enter the forward pass
through `lax.stop_gradient`, so the backward pass contains no ViT operation. The projector trains
in both phases. The optimizer freezes the same weights (zero update) until the decay step.
"""

from __future__ import annotations

import jax
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.vision.merge import check_image_batch, merge_image_embeddings
from dsv41_jax.vision.projector import Projector
from dsv41_jax.vision.vit import ViT


def image_embeddings(vit: ViT, projector: Projector, images_BxMxPxPx3: jax.Array,
                     image_cells_BxMx2: jax.Array, *, train_vit: bool) -> jax.Array:
  """LM embeddings of every image slot on its cell grid: [B, M, Gc², d]."""
  B, M, P = images_BxMxPxPx3.shape[:3]
  if not train_vit:
    graphdef, state = nnx.split(vit)
    vit = nnx.merge(graphdef, jax.lax.stop_gradient(state))
  pixels = images_BxMxPxPx3.reshape(B * M, P, P, images_BxMxPxPx3.shape[-1])
  pixels = sharding.constrain(pixels, ("batch", None, None, None))
  features, _ = vit(pixels, image_cells_BxMx2.reshape(B * M, 2))
  if not train_vit:
    features = jax.lax.stop_gradient(features)
  features = sharding.constrain(features, ("batch", None, "vit_embed"))
  e = projector(features)
  return e.reshape(B, M, e.shape[1], e.shape[2])


def embed_with_images(vit: ViT, projector: Projector, h_BxTxD: jax.Array, batch: dict, *,
                      train_vit: bool) -> jax.Array:
  """Token embeddings with the batch's image spans replaced by their image embeddings.

  Called outside `jit` (concrete arrays), the batch is first checked by `check_image_batch`; under
  `jit` the host loader must run that check (a traced batch cannot raise).
  """
  keys = ("images", "image_cells", "image_starts", "image_count", "image_mask")
  if not any(isinstance(batch.get(k), jax.core.Tracer) for k in keys):
    check_image_batch(batch, cell_px=vit.cfg.cell_px, max_image_size=vit.cfg.max_image_size)
  e = image_embeddings(vit, projector, batch["images"], batch["image_cells"], train_vit=train_vit)
  h = merge_image_embeddings(h_BxTxD, e, batch["image_cells"], batch["image_starts"],
                             batch["image_count"])
  return sharding.constrain(h, ("batch", "seq", "embed"))
