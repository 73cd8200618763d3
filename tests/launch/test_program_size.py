"""The train step's program does not grow with depth, nor the optimizer's with the number of
same-shaped parameters (the compile issue: one layer body per kind per run, batched Newton–Schulz).

Sizes are of the lowered StableHLO text: lowering only traces (no XLA compile), so these stay cheap.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from configs import common, small, tiny
from dsv41_jax import model as M
from dsv41_jax.layer_plan import build_layer_plan
from launch.step import TrainState, engram_sub_tables, make_train_step
from optim.chain import build_optimizer
from optim import muon
from optim.config import optim_config
from tests.optim import refs


def _tiny_at_depth(layers: int):
  """configs/tiny.py's widths with the small configs' Flash layout at `layers` layers."""
  cfg = common.model_config(tiny.get_config())
  return cfg.replace(vision=None, **small.layout(layers))


def _abstract_batch(cfg, B=2):
  T = cfg.seq_len
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  plan = build_layer_plan(cfg)
  n_ids = len(cfg.engram_orders) * cfg.engram_n_heads
  return dict(tokens=i32(B, T), positions=i32(B, T), segment_ids=i32(B, T), targets=i32(B, T),
              loss_mask=jax.ShapeDtypeStruct((B, T), jnp.bool_),
              engram_ids={l.index: i32(B, T, n_ids) for l in plan if l.engram})


def _train_step_hlo_bytes(cfg) -> int:
  model = M.abstract_model(cfg)
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  ocfg = optim_config(dict(tiny.get_config().optim, frozen=(), unfreeze_at="never"))
  tx = build_optimizer(ocfg, params, sub_tables=engram_sub_tables(model))
  opt_state = jax.eval_shape(tx.init, params)
  step = make_train_step(cfg, graphdef, tx, ocfg.moe_bias_gamma)
  bias = jax.ShapeDtypeStruct((cfg.num_hidden_layers, 2, cfg.n_routed_experts), jnp.float32)
  lowered = jax.jit(step, static_argnames="train_vit").lower(
      TrainState(params, opt_state, bias), _abstract_batch(cfg), train_vit=False)
  return len(lowered.as_text())


def test_train_step_program_does_not_grow_with_depth():
  shallow = _train_step_hlo_bytes(_tiny_at_depth(12))
  deep = _train_step_hlo_bytes(_tiny_at_depth(24))
  assert deep <= 1.15 * shallow, (shallow, deep)


def test_optimizer_program_does_not_grow_with_same_shaped_parameters():
  ocfg = optim_config({})

  def update_dots(n_layers: int) -> int:
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    layers = {str(i): {"attn": {"wq_a": f32(64, 32), "wq_b": f32(32, 4, 16), "wo_b": f32(64, 64)},
                       "attn_norm": {"scale": f32(64)}} for i in range(n_layers)}
    params = {"embed": f32(128, 64), "head": f32(64, 128), "runs": {"0": {"core": layers}}}
    tx = build_optimizer(ocfg, params)
    state = jax.eval_shape(tx.init, params)
    lowered = jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(params, state, params)
    return lowered.as_text().count("dot_general")

  # Newton–Schulz is one loop (3 products) per distinct matrix shape, however many parameters
  # share it: 3 shapes here (64×32, 32×16 per head, 64×64). Unbatched and unrolled, 16 layers
  # would hold 16 · 3 · 10 · 3 = 1440 products.
  # (Each step's products appear once per body the lowered loop holds: `refs.lowered_loop_bodies`.)
  assert update_dots(2) == update_dots(16) == 3 * 3 * refs.lowered_loop_bodies(
      len(muon.NS_COEFFS))
