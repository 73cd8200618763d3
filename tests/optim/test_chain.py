"""The chain (optim/chain.py): AdamW reference, clipping, weight decay, freezing, state sizes, bad
input, the config section and nnx.Optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from optim import chain, table
from optim.config import OptimConfig, OptimConfigError, optim_config, optim_defaults
from optim.table import Row, TableError
from tests.optim import refs

TABLE = (Row("emb", "sinkhorn"), Row("**/w", "muon"), Row("**/q", "muon", headwise=True),
         Row("**/scale", "adamw"))


def _cfg(**kw):
  base = dict(lr=0.01, warmup_steps=0, decay_start=1000, decay_end=2000, schedule_unit="steps",
              clip_norm=0.0)
  base.update(kw)
  return OptimConfig(**base)


def _params(rng):
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return {"emb": f(32, 8), "blk": {"w": f(2, 8, 12), "q": f(8, 2, 4), "scale": f(8)},
          "vit": {"w": f(6, 6), "scale": f(6)}}


def _grads(rng, params):
  return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)


def test_adamw_group_matches_reference_with_decay():
  rng = np.random.default_rng(0)
  cfg = _cfg()
  params = _params(rng)
  tx = chain.build_optimizer(cfg, params, TABLE)
  state = tx.init(params)
  gs = [_grads(rng, params) for _ in range(3)]
  outs = []
  for g in gs:
    u, state = tx.update(g, state, params)
    outs.append(u)
  dirs = refs.adam([np.asarray(g["blk"]["scale"]) for g in gs], 0.9, 0.95, 1e-20)
  for u, d in zip(outs, dirs):
    want = -cfg.lr * (d + 0.1 * np.asarray(params["blk"]["scale"], np.float64))
    np.testing.assert_allclose(np.asarray(u["blk"]["scale"]), want, rtol=2e-6, atol=1e-9)


def test_clipping_scales_gradients_to_the_global_norm():
  rng = np.random.default_rng(1)
  params = _params(rng)
  g = _grads(rng, params)
  norm = float(optax.tree.norm(g))
  clipped = jax.tree.map(lambda x: x * (0.5 / norm), g)
  tx_clip = chain.build_optimizer(_cfg(clip_norm=0.5), params, TABLE)
  tx_none = chain.build_optimizer(_cfg(), params, TABLE)
  u1, _ = tx_clip.update(g, tx_clip.init(params), params)
  u2, _ = tx_none.update(clipped, tx_none.init(params), params)
  # clipping to 0.5 is the same as feeding the gradients pre-scaled to norm 0.5
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), u1, u2)
  tx_big = chain.build_optimizer(_cfg(clip_norm=10 * norm), params, TABLE)
  u3, _ = tx_big.update(g, tx_big.init(params), params)
  u4, _ = tx_none.update(g, tx_none.init(params), params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), u3, u4)


def test_clip_takes_the_gradient_norm_terms_it_is_given():
  """The clip's norm from `grad_sq_sums` (the train step's, `chain.leaf_sq_sums` of the gradient):
  the same updates and state bit for bit as the clip summing the gradient itself, through steps
  with the ViT frozen (its gradient zeroed before the clip) and unfrozen, the clip acting (norm
  above 0.5). The given terms are used for every other leaf (scaled ×4 they change the step: the
  clipped gradient goes into the momenta) and never for frozen leaves, which the clip sums again
  from what it receives (NaN terms given for them change nothing). `global_norm(leaf_sq_sums(t))`
  is `optax.tree.norm(t)` bit for bit."""
  rng = np.random.default_rng(6)
  params = _params(rng)
  cfg = _cfg(frozen=("vit/**",), unfreeze_at="decay_start", decay_start=2, decay_end=4,
             clip_norm=0.5, weight_decay=0.1)
  tx = chain.build_optimizer(cfg, params, TABLE)

  @jax.jit   # one program, as in the train step, which sums the gradient beside the update
  def variants(g, state):
    sums = chain.leaf_sq_sums(g)
    nan_vit = {**sums, "vit": jax.tree.map(lambda x: x * jnp.nan, sums["vit"])}
    given = [sums, nan_vit, jax.tree.map(lambda x: 4 * x, sums)]
    return (tx.update(g, state, params), [tx.update(g, state, params, grad_sq_sums=s)
                                          for s in given],
            chain.global_norm(sums), optax.tree.norm(g))

  same = lambda a, b: all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  state = tx.init(params)
  for step in range(3):
    want, (got, nan_vit, scaled), norm, optax_norm = variants(_grads(rng, params), state)
    assert float(norm) > 0.5 and same(norm, optax_norm), step
    assert same(got, want) and same(nan_vit, want) and not same(scaled, want), step
    state = want[1]


def test_state_holds_one_buffer_for_muon_and_sinkhorn_two_for_adamw():
  rng = np.random.default_rng(2)
  params = _params(rng)
  tx = chain.build_optimizer(_cfg(clip_norm=1.0), params, TABLE)
  state = tx.init(params)
  rows = table.label_params(params, TABLE)
  want = sum(int(np.prod(v.shape)) * table.STATE_BUFFERS[rows[p].group]
             for p, v in table.flatten_params(params))
  leaves = jax.tree.leaves(state)
  assert sum(x.size for x in leaves if x.ndim > 0) == want
  assert sum(1 for x in leaves if x.ndim == 0) <= 3   # step counters only


def test_frozen_parameters_do_not_move_until_decay_start():
  rng = np.random.default_rng(3)
  params = _params(rng)
  cfg = _cfg(frozen=("vit/**",), unfreeze_at="decay_start", decay_start=2, decay_end=4,
             weight_decay=0.1)
  tx = chain.build_optimizer(cfg, params, TABLE)
  state = tx.init(params)
  for step in range(3):
    u, state = tx.update(_grads(rng, params), state, params)
    vit = [np.asarray(x) for x in jax.tree.leaves(u["vit"])]
    if step < 2:
      assert all(np.all(x == 0) for x in vit)
      assert np.all(np.asarray(u["blk"]["w"]) != 0)
    else:
      assert all(np.all(x != 0) for x in vit)
  with pytest.raises(TableError, match=r"frozen patterns matching no parameter: \['vision/\*\*'\]"):
    chain.build_optimizer(_cfg(frozen=("vision/**",)), params, TABLE)


def test_gradient_tree_that_differs_is_named():
  rng = np.random.default_rng(4)
  params = _params(rng)
  tx = chain.build_optimizer(_cfg(), params, TABLE)
  state = tx.init(params)
  g = _grads(rng, params)
  missing = {**g, "blk": {k: v for k, v in g["blk"].items() if k != "q"}}
  with pytest.raises(TableError, match=r"gradient tree lacks parameters \['blk/q'\]"):
    tx.update(missing, state, params)
  extra = {**g, "bias": jnp.zeros(3)}
  with pytest.raises(TableError, match=r"no parameter \['bias'\]"):
    tx.update(extra, state, params)
  wrong = {**g, "emb": jnp.zeros((32, 9))}
  with pytest.raises(TableError, match=r"emb \(32, 9\) \(parameter \(32, 8\)\)"):
    tx.update(wrong, state, params)


def test_config_section_round_trip_and_unknown_keys():
  import ml_collections
  from configs import flash, tiny
  assert optim_config(ml_collections.ConfigDict(optim_defaults())) == OptimConfig()
  for mod in (tiny, flash):   # each config file's section holds every field and builds
    section = mod.get_config().optim
    assert set(optim_defaults()) == set(section.keys())
    optim_config(section)
  with pytest.raises(OptimConfigError, match=r"unknown optimizer config keys \['lr_peak'\]"):
    optim_config({**optim_defaults(), "lr_peak": 1.0})
  assert optim_config({"lr": 1e-3, "frozen": ["vit/**"]}).frozen == ("vit/**",)


def test_nnx_optimizer_takes_the_chain():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 12)))
      self.q = nnx.Param(jax.random.normal(rngs.params(), (8, 2, 4)))
      self.scale = nnx.Param(jnp.ones((8,)))

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.emb = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))
      self.blk = Block(rngs)

    def __call__(self, ids):
      x = self.emb[ids] * self.blk.scale
      y = x @ self.blk.w
      z = jnp.einsum("bd,dhk->bhk", x, self.blk.q)
      return jnp.mean(y ** 2) + jnp.mean(z ** 2)

  model = Model(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  tx = chain.build_optimizer(_cfg(), params, TABLE)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  grads = nnx.grad(lambda m: m(jnp.arange(5)))(model)
  opt.update(model, grads)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), after, before)
  assert all(jax.tree.leaves(moved))


def test_adamw_chain_gives_every_group_adamw_with_its_decay_and_multipliers():
  """chain="adamw" (the ablation): no Muon or Sinkhorn state; each group's update over three steps
  equals a float64 AdamW restatement with that group's weight decay and learning-rate multiplier."""
  from optim.muon import MuonState
  from optim.sinkhorn import SinkhornState
  rng = np.random.default_rng(5)
  params = _params(rng)
  cfg = _cfg(chain="adamw", weight_decay=0.1, sinkhorn_weight_decay=0.05, muon_lr_mult=2.0,
             sinkhorn_lr_mult=0.5, adamw_lr_mult=0.25)
  tx = chain.build_optimizer(cfg, params, TABLE)
  state = tx.init(params)
  kinds = {type(s) for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, (MuonState, SinkhornState)))}
  assert not kinds & {MuonState, SinkhornState}
  rows = table.label_params(params, TABLE)
  mult = {"muon": (2.0, 0.1), "sinkhorn": (0.5, 0.05), "adamw": (0.25, 0.1)}
  gs = [_grads(rng, params) for _ in range(3)]
  outs = []
  for g in gs:
    u, state = tx.update(g, state, params)
    outs.append(dict(table.flatten_params(u)))
  p64 = {p: np.asarray(v, np.float64) for p, v in table.flatten_params(params)}
  for path, row in rows.items():
    lr_mult, wd = mult[row.group]
    dirs = refs.adam([dict(table.flatten_params(g))[path] for g in gs], 0.9, 0.95, 1e-20)
    for u, d in zip(outs, dirs):
      want = -cfg.lr * lr_mult * (d + wd * p64[path])
      np.testing.assert_allclose(np.asarray(u[path]), want, rtol=2e-6, atol=1e-9, err_msg=path)
  with pytest.raises(OptimConfigError, match=r"chain must be 'muon' or 'adamw' \(got 'sgd'\)"):
    optim_config({"chain": "sgd"})


def test_schedule_is_an_input_of_the_compiled_update():
  """`tx.update(..., schedule=schedule_of(cfg))` jitted once serves every run length and peak
  rate: fed run B's schedule, the program built for run A gives run B's updates (the chain built
  from B's config, schedule as constants) bit for bit, at each of four steps through warm-up,
  hold, decay and (frozen ViT) unfreezing; it compiles one program for both."""
  from optim.schedule import schedule_of
  rng = np.random.default_rng(5)
  params = _params(rng)
  grads = [_grads(rng, params) for _ in range(4)]
  kw = dict(schedule_unit="fraction", warmup_steps=1, decay_start=0.5, decay_end=1.0,
            frozen=("vit/**",), unfreeze_at="decay_start", weight_decay=0.1, clip_norm=1.0)
  cfg_a, cfg_b = _cfg(total_steps=40, **kw), _cfg(total_steps=4, lr=0.03, **kw)
  tx_a, tx_b = (chain.build_optimizer(c, params, TABLE) for c in (cfg_a, cfg_b))
  update = jax.jit(lambda g, s, p, sc: tx_a.update(g, s, p, schedule=sc))
  for cfg, tx in ((cfg_a, tx_a), (cfg_b, tx_b)):
    state, want_state = tx_a.init(params), tx.init(params)
    for step, g in enumerate(grads):
      got, state = update(g, state, params, schedule_of(cfg))
      want, want_state = jax.jit(tx.update)(g, want_state, params)
      for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      moved = any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(got["vit"]))
      assert moved == (step >= (2 if cfg is cfg_b else 20))
  assert update._cache_size() == 1
