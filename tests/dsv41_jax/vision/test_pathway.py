"""The vision pathway inside `dsv41_jax.model.Transformer`: image spans reach the LM causally, the
frozen ViT gets no gradient (and does after the switch), the optimizer freezes and scales it, and a
sharded run equals the single-device one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import model as M, testing
from dsv41_jax.config import ModelConfig
from dsv41_jax.loss import objective
from dsv41_jax.vision.merge import check_image_batch
from dsv41_jax.vision.pathway import embed_with_images, image_embeddings
from optim import OptimConfig, build_optimizer
from optim.chain import frozen_trainable

PAD, IMG = 0, 3
T, CANVAS = 32, 84


def micro_config() -> ModelConfig:
  """Two SWA layers (Engram on the second) and a one-layer ViT on an 84-px canvas (2 × 2 cells)."""
  return testing.tiny_config(
      num_hidden_layers=2, compress_ratios=(0, 0), kv_source_layer_ids=(),
      index_source_layer_ids=(), engram_layer_ids=(1,), seq_len=T,
      vision=testing.tiny_vision_config(max_image_size=CANVAS))


def make_batch(cfg, seed=0, rows=4):
  """Rows with two, one, no and two images (row 0: two documents), as jnp arrays."""
  b = testing.packed_batch(cfg, seed, batch_size=rows, image_spans=(2, 1, 0, 2)[:rows],
                           pad_id=PAD, image_token_id=IMG)
  check_image_batch(b, cell_px=42, max_image_size=CANVAS)
  return jax.tree.map(jnp.asarray, b)


@pytest.fixture(scope="module")
def cfg():
  return micro_config()


@pytest.fixture(scope="module")
def split_model(cfg):
  return nnx.split(M.Transformer(cfg, nnx.Rngs(0)))


def _loss(graphdef, cfg, train_vit):
  def loss_fn(params, batch):
    logits, aux = nnx.merge(graphdef, params)(batch, M.zero_moe_bias(cfg), train_vit=train_vit)
    return objective(cfg, logits, aux, batch)[0], logits
  return loss_fn


@pytest.fixture(scope="module")
def value_and_grad(cfg, split_model):
  """Jitted (loss, logits), grads for train_vit False / True (shared by the tests: one compile)."""
  graphdef, _ = split_model
  return {tv: jax.jit(jax.value_and_grad(_loss(graphdef, cfg, tv), has_aux=True))
          for tv in (False, True)}


def test_param_paths_and_ledger(split_model):
  from configs import common, flash
  from dsv41_jax import ledger
  _, state = split_model
  tops = {k[0] for k, _ in nnx.to_flat_state(state)}
  assert {"vision", "projector"} <= tops
  fcfg = common.model_config(flash.get_config())
  v, d = fcfg.vision, fcfg.hidden_size
  D, F, L, u2 = v.hidden_size, v.intermediate_size, v.num_layers, v.unshuffle ** 2
  vit = v.patch_dim * D + L * (4 * D * D + 3 * D * F + 2 * D) + D
  proj = u2 * D + u2 * D * v.projector_hidden + v.projector_hidden * d
  led = ledger.ledger(fcfg)
  assert led["vision_params"] == vit + proj
  assert led["backbone_params"] + led["engram_params"] + vit + proj == led["total_params"]


def test_images_reach_only_later_positions_of_their_document(cfg, split_model, value_and_grad):
  _, state = split_model
  fwd = lambda b: value_and_grad[True](state, b)[0][1]   # the logits (reuses the compiled step)
  batch = make_batch(cfg)
  base = np.asarray(fwd(batch))
  # Row 0 holds two documents and two images; change the pixels of its second image.
  px = np.asarray(batch["images"]).copy()
  px[0, 1] = np.random.default_rng(9).integers(0, 256, px[0, 1].shape)
  changed = np.abs(np.asarray(fwd(dict(batch, images=jnp.asarray(px)))) - base).max(-1)
  start = int(batch["image_starts"][0, 1])
  doc = np.asarray(batch["segment_ids"][0]) == int(batch["segment_ids"][0, start])
  assert changed[0, :start].max() == 0.0                  # causal: nothing before the span moves
  assert (changed[0, start:][doc[start:]] > 1e-6).all()   # the span and the rest of its document do
  assert changed[0][~doc].max() == 0.0                    # the other document does not
  assert changed[1:].max() == 0.0                         # nor other rows


def test_frozen_vit_gets_no_gradient_and_unfrozen_does(cfg, split_model, value_and_grad):
  graphdef, state = split_model
  batch = make_batch(cfg, seed=1)

  def grads(train_vit):
    return value_and_grad[train_vit](state, batch)[1]

  def sizes(g, top):
    return [float(jnp.abs(v[...]).max()) for k, v in nnx.to_flat_state(g) if k[0] == top]

  frozen, trained = grads(False), grads(True)
  assert all(x == 0.0 for x in sizes(frozen, "vision"))
  assert all(x > 0.0 for x in sizes(trained, "vision"))
  assert all(x > 0.0 for x in sizes(frozen, "projector"))   # the projector trains in both phases
  # "No gradient computed": the frozen backward pass holds no ViT matrix product (the pathway
  # alone: 2 ViT products per patch-embed/q/k/v/o/w1/w3/w2 weight would appear in the backward).
  def n_dots(train_vit):
    vit, proj = nnx.merge(graphdef, state).vision, nnx.merge(graphdef, state).projector
    g, s = nnx.split((vit, proj))
    f = lambda s: jnp.sum(image_embeddings(*nnx.merge(g, s), batch["images"], batch["image_cells"],
                                           train_vit=train_vit))
    return str(jax.make_jaxpr(jax.grad(f))(s)).count("dot_general")
  assert n_dots(False) + 2 * 8 <= n_dots(True)


def test_optimizer_freezes_the_vit_until_decay_then_scales_it(cfg, split_model):
  model = nnx.merge(*split_model)
  params = {"vision": nnx.as_pure(nnx.state(model.vision, nnx.Param)),
            "projector": nnx.as_pure(nnx.state(model.projector, nnx.Param))}
  oc = OptimConfig(lr=1e-2, warmup_steps=0, schedule_unit="steps", decay_start=2, decay_end=10,
                   frozen=("vision/**",), unfreeze_at="decay_start", vision_lr_mult=0.1,
                   clip_norm=0.0)
  full = OptimConfig(**{**oc.__dict__, "vision_lr_mult": 1.0})
  rng = np.random.default_rng(3)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  tx, tx_full = build_optimizer(oc, params), build_optimizer(full, params)
  s, s_full = tx.init(params), tx_full.init(params)
  vision_paths = lambda u: [np.asarray(v) for v in jax.tree.leaves(u["vision"])]
  for step in range(3):
    assert frozen_trainable(oc, step) == (step >= 2)
    u, s = tx.update(grads, s, params)
    u_full, s_full = tx_full.update(grads, s_full, params)
    vis, vis_full = vision_paths(u), vision_paths(u_full)
    if step < 2:
      assert all((v == 0).all() for v in vis)
    else:
      assert all(np.abs(v).max() > 0 for v in vis)
      for a, b in zip(vis, vis_full):
        np.testing.assert_allclose(a, 0.1 * b, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("slot_budget", [0, 2])
def test_sharded_pathway_and_gradients_equal_single_device(cfg, split_model, slot_budget):
  """ViT → projector → span merge on a (data 2, expert 2, tensor 2) mesh of 8 CPU devices equals
  one device, value and gradients (the LM's own sharding is tested in test_model.py); with a slot
  budget the ViT runs on each batch shard's filled slots (2 of 4 a row there, 2 of 4 on one
  device)."""
  model = nnx.merge(*split_model)
  vit = nnx.merge(*nnx.split(model.vision))
  vit.cfg = cfg.vision.replace(slot_budget=slot_budget)
  graphdef, state = nnx.split((vit, model.projector))
  batch = make_batch(cfg, seed=2)
  if slot_budget:
    batch = _with_empty_slots(batch, extra=2, seed=4)
  rng = np.random.default_rng(5)
  h = jnp.asarray(rng.normal(size=(4, T, cfg.hidden_size)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, T, cfg.hidden_size)), jnp.float32)

  @jax.jit
  @jax.value_and_grad
  def fn(s, h, batch):
    vit, proj = nnx.merge(graphdef, s)
    return jnp.sum(embed_with_images(vit, proj, h, batch, train_vit=True) * w)

  scale = lambda a: max(float(np.abs(np.asarray(a)).max()), 1e-6)
  testing.assert_sharded_matches(
      fn, (state, h, batch), testing.cpu_mesh({"data": 2, "expert": 2, "tensor": 2}),
      rtol=lambda path, _: 1e-5 if path == "[0]" else 1e-4,
      atol=lambda path, a: 0.0 if path == "[0]" else 1e-5 * scale(a))


def test_eager_call_checks_the_rows(cfg, split_model):
  model = nnx.merge(*split_model)
  batch = make_batch(cfg, seed=6)
  mask = np.asarray(batch["image_mask"]).copy()
  mask[3, int(batch["image_starts"][3, 1])] = False
  with pytest.raises(ValueError, match=rf"row 3: {mask[3].sum()} placeholder tokens do not match "
                                       r"its 2 images"):
    model(dict(batch, image_mask=jnp.asarray(mask)), M.zero_moe_bias(cfg))


def _with_empty_slots(batch, extra, seed):
  """The batch with `extra` more image slots a row, empty (start −1, 0 × 0 cells) but holding
  random pixels: what an empty slot holds must not matter."""
  rng = np.random.default_rng(seed)
  B, _, P = batch["images"].shape[:3]
  noise = rng.integers(0, 256, (B, extra, P, P, 3), dtype=np.uint8)
  return dict(batch,
              images=jnp.concatenate([batch["images"], jnp.asarray(noise)], axis=1),
              image_cells=jnp.concatenate([batch["image_cells"],
                                           jnp.zeros((B, extra, 2), jnp.int32)], axis=1),
              image_starts=jnp.concatenate([batch["image_starts"],
                                            jnp.full((B, extra), -1, jnp.int32)], axis=1))


@pytest.mark.parametrize("groups", [1, 2])
def test_filled_slots_gather_exactly_the_filled_images(groups):
  # A row-wise stand-in for the ViT + projector (each slot's embedding a function of its own
  # pixels and cells): the filled-slot path equals every slot's bit for bit at the filled slots,
  # reads zeros at the empty ones after running the stand-in over W·C rows when the filled slots
  # fit, and is the every-slot form itself when a group holds more than C.
  from dsv41_jax.vision.pathway import _filled_slots
  rng = np.random.default_rng(groups)
  B, M, P, G, D = 4, 5, 6, 3, 2
  images = jnp.asarray(rng.integers(0, 256, (B, M, P, P, 3), dtype=np.uint8))
  cells = jnp.asarray(rng.integers(1, 3, (B, M, 2)), jnp.int32)
  rows_seen = []

  def embed(px, ce):
    rows_seen.append(px.shape[0])
    v = px.astype(jnp.float32).mean(axis=(1, 2, 3)) + 1000.0 * ce[:, 0] + 7.0 * ce[:, 1]
    return jnp.broadcast_to(v[:, None, None] * jnp.arange(1, G * D + 1).reshape(G, D), (
        px.shape[0], G, D))

  every = lambda: embed(images.reshape(B * M, P, P, 3), cells.reshape(B * M, 2)).reshape(
      B, M, G, D)
  want = np.asarray(every())
  mesh = testing.cpu_mesh({"data": groups}) if groups > 1 else None
  for count, budget in [((2, 0, 5, 1), 2), ((1, 0, 0, 1), 1), ((5, 5, 0, 0), 2), ((0, 0, 0, 0), 1)]:
    count = jnp.asarray(count, jnp.int32)
    rows_seen.clear()
    if mesh is None:
      got = np.asarray(_filled_slots(embed, every, images, cells, count, budget))
    else:
      with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        got = np.asarray(jax.jit(lambda c: _filled_slots(embed, every, images, cells, c, budget)
                                 )(count))
    filled = np.arange(M)[None, :] < np.asarray(count)[:, None]
    np.testing.assert_array_equal(got[filled], want[filled])
    R = B // groups
    fits = max(int(np.asarray(count)[g * R:(g + 1) * R].sum()) for g in range(groups)) <= R * budget
    if fits:      # the gathered form: W·C rows embedded, zeros at the empty slots
      assert (got[~filled] == 0).all() and groups * R * budget in rows_seen, rows_seen
    else:         # every slot, the empty ones' embeddings too
      np.testing.assert_array_equal(got, want)


def test_slot_budget_gives_the_every_slot_embeddings_and_gradients(cfg, split_model):
  # The real ViT and projector, trained: value and gradients with the filled slots only (budget 2:
  # 8 places for 5 images) and with the budget overflowed (1: 4 places, so every slot) equal the
  # every-slot form within float32 rounding of the ViT's products over other row counts.
  model = nnx.merge(*split_model)
  batch = _with_empty_slots(make_batch(cfg, seed=2), extra=2, seed=3)
  rng = np.random.default_rng(5)
  h = jnp.asarray(rng.normal(size=(4, T, cfg.hidden_size)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, T, cfg.hidden_size)), jnp.float32)

  def run(budget):
    vit = nnx.merge(*nnx.split(model.vision))
    vit.cfg = cfg.vision.replace(slot_budget=budget)
    graphdef, state = nnx.split((vit, model.projector))
    f = jax.jit(jax.value_and_grad(lambda s: jnp.sum(
        embed_with_images(*nnx.merge(graphdef, s), h, batch, train_vit=True) * w)))
    return f(state)

  ref_value, ref_grad = run(0)
  for budget in (2, 1):
    value, grad = run(budget)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                 atol=1e-6 * max(float(np.abs(np.asarray(b)).max()), 1e-6))
