"""The vision pathway end to end: pixels → ViT → pixel-unshuffle + projector → placeholder spans
(docs/design.md §15; §T2 for the freeze).

  f, _   = ViT(images.reshape(B·M, P, P, 3), cells)          [B·M, G², D_vit]
  f      = stop_gradient(f and the ViT weights)              while the ViT is frozen
  e      = Projector(f)                                      [B·M, Gc², d] → [B, M, Gc², d]
  h      = merge_image_embeddings(token embeddings, e, ...)  [B, T, d]

With `VisionConfig.slot_budget` > 0 the ViT and projector run over the filled slots alone when
they fit the budget (`_filled_slots`), every slot otherwise.

Frozen means no gradient is computed for the ViT at all: its weights enter the forward pass
through `lax.stop_gradient`, so the backward pass contains no ViT operation. The projector trains
in both phases. The optimizer freezes the same weights (zero update) until the decay step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.vision.merge import check_image_batch, merge_image_embeddings
from dsv41_jax.vision.projector import Projector
from dsv41_jax.vision.vit import ViT


def image_embeddings(vit: ViT, projector: Projector, images_BxMxPxPx3: jax.Array,
                     image_cells_BxMx2: jax.Array, *, train_vit: bool,
                     image_count_B: jax.Array | None = None) -> jax.Array:
  """LM embeddings of every image slot on its cell grid: [B, M, Gc², d]. With `image_count_B` and
  `vit.cfg.slot_budget` > 0 the ViT and projector run over the filled slots only
  (`_filled_slots`), and the empty slots' embeddings are zeros (the span merge never reads them)."""
  B, M, P = images_BxMxPxPx3.shape[:3]
  if not train_vit:
    graphdef, state = nnx.split(vit)
    vit = nnx.merge(graphdef, jax.lax.stop_gradient(state))

  def embed(pixels_NxPxPx3, cells_Nx2):
    pixels = sharding.constrain(pixels_NxPxPx3, ("batch", None, None, None))
    features, _ = vit(pixels, cells_Nx2)
    if not train_vit:
      features = jax.lax.stop_gradient(features)
    features = sharding.constrain(features, ("batch", None, "vit_embed"))
    return projector(features)

  def every_slot():
    e = embed(images_BxMxPxPx3.reshape(B * M, P, P, images_BxMxPxPx3.shape[-1]),
              image_cells_BxMx2.reshape(B * M, 2))
    return e.reshape(B, M, e.shape[1], e.shape[2])

  budget = vit.cfg.slot_budget
  if image_count_B is None or budget == 0 or budget >= M:
    return every_slot()
  return _filled_slots(embed, every_slot, images_BxMxPxPx3, image_cells_BxMx2, image_count_B,
                       budget)


def _filled_slots(embed, every_slot, images_BxMxPxPx3, image_cells_BxMx2, image_count_B, budget):
  """The embeddings of the filled slots, the ViT run over them alone where they fit.

  The rows of each batch shard (W shards of R rows: the mesh's batch ways, 1 without a mesh) form
  one group of S = R·M slots, of which the first `image_count` of each row are filled. A group's
  c-th filled slot is the first whose running count of filled slots reaches c + 1 (a binary
  search of the running count, no sort); C = R·budget of them are gathered per group ([W, C]
  pixels and cells, empty places with 0 × 0 cells), embedded, and read back by each filled slot's
  place (its running count − 1; an empty slot reads a row of zeros). A `lax.cond` takes every slot
  instead when the fullest group holds more than C, so no image is ever left out. All gathers are
  within a group, so a sharded batch stays on its devices."""
  B, M, P = images_BxMxPxPx3.shape[:3]
  mesh = sharding.context_mesh()
  W = 1 if mesh is None else sharding.batch_ways(mesh)
  W = W if B % W == 0 else 1
  R = B // W
  S, C = R * M, R * budget
  filled_WxS = (jnp.arange(M)[None, :] < image_count_B[:, None]).reshape(W, S)
  running_WxS = jnp.cumsum(filled_WxS, axis=1, dtype=jnp.int32)
  fullest = jnp.max(running_WxS[:, -1])

  def gathered():
    want = jnp.arange(1, C + 1, dtype=jnp.int32)
    src_WxC = jax.vmap(lambda r: jnp.searchsorted(r, want, side="left"))(running_WxS)
    real_WxC = src_WxC < S
    src_WxC = jnp.minimum(src_WxC, S - 1).astype(jnp.int32)
    group = lambda a: sharding.constrain(a.reshape(W, S, *a.shape[2:]),
                                         ("batch",) + (None,) * (a.ndim - 1))
    pixels = jnp.take_along_axis(group(images_BxMxPxPx3), src_WxC[:, :, None, None, None], axis=1)
    cells = jnp.take_along_axis(group(image_cells_BxMx2), src_WxC[:, :, None], axis=1)
    cells = jnp.where(real_WxC[..., None], cells, 0)
    e = embed(pixels.reshape(W * C, *pixels.shape[2:]), cells.reshape(W * C, 2))
    e = e.reshape(W, C, e.shape[1], e.shape[2])
    e = jnp.concatenate([e, jnp.zeros((W, 1) + e.shape[2:], e.dtype)], axis=1)
    place_WxS = jnp.where(filled_WxS, running_WxS - 1, C)
    out = jnp.take_along_axis(e, place_WxS[:, :, None, None], axis=1)
    return out.reshape(B, M, out.shape[2], out.shape[3])

  return jax.lax.cond(fullest <= C, gathered, every_slot)


def embed_with_images(vit: ViT, projector: Projector, h_BxTxD: jax.Array, batch: dict, *,
                      train_vit: bool) -> jax.Array:
  """Token embeddings with the batch's image spans replaced by their image embeddings.

  Called outside `jit` (concrete arrays), the batch is first checked by `check_image_batch`; under
  `jit` the host loader must run that check (a traced batch cannot raise).
  """
  keys = ("images", "image_cells", "image_starts", "image_count", "image_mask")
  if not any(isinstance(batch.get(k), jax.core.Tracer) for k in keys):
    check_image_batch(batch, cell_px=vit.cfg.cell_px, max_image_size=vit.cfg.max_image_size)
  e = image_embeddings(vit, projector, batch["images"], batch["image_cells"], train_vit=train_vit,
                       image_count_B=batch["image_count"])
  h = merge_image_embeddings(h_BxTxD, e, batch["image_cells"], batch["image_starts"],
                             batch["image_count"])
  return sharding.constrain(h, ("batch", "seq", "embed"))
