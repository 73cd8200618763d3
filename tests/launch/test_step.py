"""launch/step.py: a step whose loss, gradients or update norm are not finite applies nothing
(parameters, optimizer state and MoE bias come back bit for bit), even though every parameter is
finite (docs/design.md §T2, §T6); the evaluation step's sums against float64.

The step is generic in the model: it merges the graphdef it is given and reads the model's call
interface (`(logits, aux)` from `(inputs, moe_bias, train_vit=...)`). A toy module with that
interface makes the cases exact and cheap to compile:
* a NaN injected into the gradient of one leaf (`w`) while the loss stays finite;
* an infinite loss from one row: finite logits ±3e38 whose cross-entropy overflows float32;
* finite loss and gradients with an update norm that is not: Σu² overflowing while every update
  is finite, or a NaN in Adam's state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import testing
from dsv41_jax.config import ModelConfig
from launch.step import TrainState, make_eval_step, make_train_step
from optim.chain import build_optimizer
from optim.config import OptimConfig
from optim.table import Row

V, D, L, E = 16, 8, 1, 4
HUGE = 3e38   # finite in float32; (+HUGE) − (−HUGE) overflows
BATCH_CFG = testing.tiny_config(vocab_size=V, engram_layer_ids=())   # the batch layout only


@jax.custom_vjp
def _poison_grad(w):
  return w


def _poison_fwd(w):
  return w, None


def _poison_bwd(_, g):
  return (g.at[0, 0].set(jnp.nan),)


_poison_grad.defvjp(_poison_fwd, _poison_bwd)


class Toy(nnx.Module):
  """logits = (embed[tokens] ⊙ scale) @ w; expert loads from the tokens, so the bias moves."""

  def __init__(self, poison: bool, rngs: nnx.Rngs):
    self.poison = poison
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (V, D)))
    self.w = nnx.Param(jax.random.normal(rngs.params(), (D, V)) / np.sqrt(D))
    self.scale = nnx.Param(jnp.ones((D,)))

  def __call__(self, inputs, moe_bias, train_vit=True):
    w = _poison_grad(self.w[...]) if self.poison else self.w[...]
    logits = jnp.einsum("btd,dv->btv", self.embed[...][inputs["tokens"]] * self.scale[...], w)
    load = jax.nn.one_hot(inputs["tokens"] % E, E).sum((0, 1))
    aux = dict(balance_loss=jnp.zeros((L,)), indexer_loss=jnp.zeros((L,)),
               load_2xE=jnp.stack([load, jnp.zeros(E)])[None], dropped_fraction=jnp.zeros((L,)),
               engram_gate_N=jnp.zeros((0,)), engram_rows_touched=jnp.zeros((0,)))
    return logits, aux


TABLE = (Row("embed", "sinkhorn"), Row("w", "muon"), Row("scale", "adamw"))


def _setup(poison: bool):
  model = Toy(poison, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  ocfg = OptimConfig(lr=0.01, warmup_steps=0, decay_start=10, decay_end=20, schedule_unit="steps")
  tx = build_optimizer(ocfg, params, TABLE)
  step = jax.jit(make_train_step(ModelConfig(), graphdef, tx, bias_gamma=0.001))
  return step, params, tx.init(params)


def _batch(rng, huge_row: bool = False):
  """Three packed rows (`testing.packed_batch`, padding token 1). With `huge_row`, row 1's first
  loss position holds token 0 with target 1, and token 0 occurs nowhere else."""
  batch = testing.packed_batch(BATCH_CFG, rng, batch_size=3, pad_id=1)
  if huge_row:
    tokens = batch["tokens"]
    tokens[tokens == 0] = 2
    t = int(np.argmax(batch["loss_mask"][1]))
    tokens[1, t:t + 2] = (0, 1)
    batch = testing.make_batch(BATCH_CFG, tokens, batch["segment_ids"], pad_id=1)
  return batch


def _leaves_equal(a, b):
  """Bit for bit: NaN equals the same NaN, −0 differs from +0."""
  return all(np.asarray(x).dtype == np.asarray(y).dtype
             and np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("case", ["nan_gradient_leaf", "infinite_loss_row"])
def test_nonfinite_step_with_finite_params_applies_nothing(case):
  rng = np.random.default_rng(0)
  step, params, opt_state = _setup(poison=case == "nan_gradient_leaf")
  bias = jnp.asarray(np.random.default_rng(1).normal(size=(L, 2, E)), jnp.float32)
  if case == "infinite_loss_row":
    # token 0 (one position of one row) puts +HUGE on every class but its target's, which gets
    # −HUGE; no other token reads w[0]
    row = np.full(V, HUGE, np.float32)
    row[1] = -HUGE
    params["embed"] = params["embed"].at[:, 0].set(0.0).at[0].set(0.0).at[0, 0].set(1.0)
    params["w"] = params["w"].at[0].set(jnp.asarray(row))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))

  batch = _batch(rng, huge_row=case == "infinite_loss_row")
  (new_params, new_opt, new_bias), m = step(TrainState(params, opt_state, bias), batch)
  assert not bool(m["finite"])
  if case == "nan_gradient_leaf":
    assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
  else:
    assert float(m["loss"]) == np.inf
  assert _leaves_equal(new_params, params)
  assert _leaves_equal(new_opt, opt_state)
  assert _leaves_equal(new_bias, bias)


@pytest.mark.parametrize("case", ["norm_overflows", "nan_adam_state"])
def test_nonfinite_update_norm_with_finite_loss_and_gradients_applies_nothing(case):
  """The third condition of the guard: loss and gradient norm finite, the update norm not.
  * norm_overflows: every update is finite, only Σu² overflows float32. scale[0] = 1e37 is read
    by nothing (embed[:, 0] = 0 and w[0] = 0 zero its product and both its gradients), so the
    loss and gradients stay as usual, while its weight decay −lr·0.1·1e37 = −1e34 squares past
    float32's 3.4e38. A guard that tested the updates elementwise would apply this step.
  * nan_adam_state: a NaN in Adam's second moment (optimizer state gone bad) makes a NaN update
    from finite gradients; the state, NaN included, must come back as it was."""
  step, params, opt_state = _setup(poison=False)
  bias = jnp.asarray(np.random.default_rng(1).normal(size=(L, 2, E)), jnp.float32)
  if case == "norm_overflows":
    params["embed"] = params["embed"].at[:, 0].set(0.0)
    params["w"] = params["w"].at[0].set(0.0)
    params["scale"] = params["scale"].at[0].set(1e37)
  else:
    poison = lambda path, x: (x.at[0].set(jnp.nan) if "nu" in jax.tree_util.keystr(path)
                              and "scale" in jax.tree_util.keystr(path) else x)
    opt_state = jax.tree_util.tree_map_with_path(poison, opt_state)
    assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(opt_state))
  state = TrainState(params, opt_state, bias)
  before = jax.tree.map(np.asarray, state)      # the step donates nothing here; kept as numpy
  new, m = step(state, _batch(np.random.default_rng(0)))
  assert not bool(m["finite"])
  assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
  assert not np.isfinite(float(m["update_norm"]))
  if case == "norm_overflows":
    assert float(m["update_norm"]) == np.inf
  assert _leaves_equal(new.params, before.params)
  assert _leaves_equal(new.opt_state, before.opt_state)
  assert _leaves_equal(new.moe_bias, before.moe_bias)


def test_finite_step_applies_everything():
  """The control: the same toy and a finite batch move parameters, optimizer state and bias."""
  step, params, opt_state = _setup(poison=False)
  bias = jnp.zeros((L, 2, E), jnp.float32)
  (new_params, new_opt, new_bias), m = step(TrainState(params, opt_state, bias),
                                            _batch(np.random.default_rng(0)))
  assert bool(m["finite"]) and np.isfinite(float(m["loss"]))
  for x, y in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
    assert not np.array_equal(np.asarray(x), np.asarray(y))
  assert not _leaves_equal(new_opt, opt_state)
  assert not _leaves_equal(new_bias, bias)


def test_gradient_is_summed_once_for_its_norm_and_the_clip():
  """One full Σx² per parameter for the gradient's norm, shared by the `grad_norm` metric and the
  chain's clip (`grad_sq_sums`), and one for the update norm: 2 per parameter in the step's
  program, where the clip summing the gradient again made 3 (a second read of every gradient
  whenever XLA cannot merge the two, e.g. with frozen parameters)."""
  step, params, opt_state = _setup(poison=False)
  state = TrainState(params, opt_state, jnp.zeros((L, 2, E), jnp.float32))
  jaxpr = jax.make_jaxpr(step)(state, _batch(np.random.default_rng(0)))
  shapes = {x.shape for x in jax.tree.leaves(params)}
  assert len(shapes) == len(jax.tree.leaves(params)) == 3    # each parameter told by its shape
  whole = lambda e: (e.invars[0].aval.shape in shapes and e.outvars[0].aval.shape == ()
                     and len(e.params["axes"]) == e.invars[0].aval.ndim)
  assert len(testing.jaxpr_eqns(jaxpr, "reduce_sum", whole)) == 2 * 3


def test_eval_step_sums_cross_entropy_tokens_and_bytes():
  """`make_eval_step` against float64 numpy: Σ cross-entropy over the loss positions, their
  count, and Σ token_bytes[target] over them (the bits-per-byte denominator).

  Tolerance: each float32 logit is a sum of D = 8 products of unit size, off by ≲ D·2⁻²⁴·3 ≈ 1.5e-6;
  a cross-entropy term (≈ 3.3) by twice that, so the sum of n ≈ 80 terms by ≲ 1e-6 relative; the
  float32 tree sum and the mean's rescaling by n add ≲ (log₂ n + 2)·2⁻²⁴ ≈ 5e-7. Measured: ≤ 1.4e-7.
  Summing every position instead of the loss positions is off by 10–30 % here."""
  model = Toy(False, nnx.Rngs(3))
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  rng = np.random.default_rng(4)
  batch = _batch(rng)
  token_bytes = rng.integers(1, 5, size=V).astype(np.int32)
  bias = jnp.zeros((L, 2, E), jnp.float32)
  total, n, n_bytes = jax.jit(make_eval_step(ModelConfig(), graphdef))(params, bias, batch,
                                                                      jnp.asarray(token_bytes))

  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  logits = (p["embed"][batch["tokens"]] * p["scale"]) @ p["w"]
  m = logits.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  picked = np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
  mask = batch["loss_mask"]
  assert 0 < mask.sum() < mask.size
  np.testing.assert_allclose(float(total), (lse - picked)[mask].sum(), rtol=2e-6)
  assert int(n) == mask.sum()
  assert int(n_bytes) == token_bytes[batch["targets"]][mask].sum()


def test_engram_sub_tables_of_the_model_are_its_hash_tables():
  """The layout launch code passes (`launch.step.engram_sub_tables`) is that of docs/design.md §7.2."""
  from flax import nnx

  from configs.common import model_config
  from dsv41_jax import model as model_lib
  from dsv41_jax.engram import hashing
  from launch.step import engram_sub_tables
  from optim import table as table_lib
  from configs import tiny

  mcfg = model_config(tiny.get_config("micro"))
  abstract = model_lib.abstract_model(mcfg)
  layout = engram_sub_tables(abstract)
  shapes = {p: v.shape for p, v in table_lib.flatten_params(nnx.state(abstract, nnx.Param))}
  want = set()
  for layer in mcfg.engram_layer_ids:
    hp = hashing.engram_hash_params(mcfg, layer)
    want.add(tuple(zip(hp.offsets.reshape(-1).tolist(), hp.primes.reshape(-1).tolist())))
  assert set(layout.values()) == want and len(layout) == len(mcfg.engram_layer_ids)
  for path, blocks in layout.items():
    assert path.endswith("engram/table") and shapes[path][-2] >= sum(n for _, n in blocks)


# --- gradient accumulation -------------------------------------------------------------------

def test_accumulated_toy_step_equals_one_step_over_the_whole_batch():
  """The toy (LM loss and expert loads only) on four rows of unequal loss-token counts: 2 and 4
  micro-batches give one step's parameters, optimizer state, MoE biases and metrics over the whole
  batch (float32 rounding of the reordered sums)."""
  model = Toy(False, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  ocfg = OptimConfig(lr=0.01, warmup_steps=0, decay_start=10, decay_end=20, schedule_unit="steps")
  tx = build_optimizer(ocfg, params, TABLE)
  batch = testing.packed_batch(BATCH_CFG, 4, batch_size=4, pad_id=1, pad_from=[None, 5, None, 20])
  counts = np.asarray(batch["loss_mask"]).sum(1)
  assert len(set(counts[[0, 2]].tolist() + [counts[[1, 3]].sum() - counts[[0, 2]].sum()])) > 1
  state = TrainState(params, tx.init(params), jnp.zeros((L, 2, E), jnp.float32))
  ref_state, ref_m = jax.jit(make_train_step(ModelConfig(), graphdef, tx, 0.001))(state, batch)
  for k in (2, 4):
    new_state, m = jax.jit(make_train_step(ModelConfig(), graphdef, tx, 0.001, k))(state, batch)
    _assert_same_step(state, new_state, ref_state, m, ref_m, k)


def _assert_same_step(state, new_state, ref_state, m, ref_m, k):
  """The optimizer's moments (the gradients, summed in another order) within 2e-5 of each leaf's
  largest entry (observed on the micro model: ≤ 1.1e-6 at k = 2, 7.7e-6 at k = 4 on the Engram
  gate weights, whose gradient cancels over tokens); parameters within 2e-3 of how far each
  leaf moved: Newton–Schulz amplifies that rounding in small singular directions, most on the mHC
  `fn` matrices (observed ≤ 7.7e-4, elsewhere ≤ 5e-5; cf. test_train's other-mesh restore); MoE
  biases exactly (sign steps of integer loads); metrics to float32 rounding."""
  for (path, a), b, o in zip(jax.tree_util.tree_flatten_with_path(new_state.params)[0],
                             jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)):
    a, b, o = (np.asarray(x, np.float64) for x in (a, b, o))
    assert np.abs(a - b).max() <= 2e-3 * np.abs(b - o).max(), (k, jax.tree_util.keystr(path))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new_state.opt_state)[0],
                          jax.tree.leaves(ref_state.opt_state)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(a - b).max() <= 2e-5 * np.abs(b).max(), (k, jax.tree_util.keystr(path))
  np.testing.assert_array_equal(np.asarray(new_state.moe_bias), np.asarray(ref_state.moe_bias))
  assert set(m) == set(ref_m)
  for name in ref_m:
    np.testing.assert_allclose(np.asarray(m[name], np.float64), np.asarray(ref_m[name], np.float64),
                               rtol=2e-6, atol=1e-9, err_msg=f"k={k} {name}")

def _micro_model_config():
  """configs/tiny.py:micro's model: two Full layers at ratios 2 and 1 with indexers, Engram,
  MoE whose capacity never drops a token, float32."""
  from configs import tiny
  from configs.common import model_config
  return model_config(tiny.get_config("micro"))


ACCUM_CFG = _micro_model_config()


def _accum_setup(ks=(1, 2, 4)):
  from dsv41_jax.model import init_model
  from launch.step import engram_sub_tables
  model = init_model(ACCUM_CFG, seed=0)
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  ocfg = OptimConfig(lr=3e-3, warmup_steps=0, decay_start=10, decay_end=20, schedule_unit="steps",
                     moe_bias_gamma=0.01)
  tx = build_optimizer(ocfg, params, sub_tables=engram_sub_tables(model))
  # rows of very different token counts: 1-3 documents, trailing padding in two rows, image spans
  batch = testing.packed_batch(ACCUM_CFG, 3, batch_size=4, max_docs=3, image_spans=[1, 0, 0, 2],
                               pad_from=[None, 9, None, 20])
  bias = jnp.asarray(np.random.default_rng(2).normal(0, 0.01, (ACCUM_CFG.num_hidden_layers, 2,
                                                               ACCUM_CFG.n_routed_experts)),
                     jnp.float32)
  state = TrainState(params, tx.init(params), bias)
  steps = {k: jax.jit(make_train_step(ACCUM_CFG, graphdef, tx, ocfg.moe_bias_gamma, k))
           for k in ks}
  return steps, state, batch


@pytest.fixture(scope="module")
def accum_setup():
  return _accum_setup()


@pytest.mark.slow  # three compiles of the micro model's whole step (~1-2 min each on 2 cores)
def test_accumulated_step_equals_one_step_over_the_whole_batch(accum_setup):
  """The micro model (indexer, balance and Engram means, MoE loads): k ∈ {2, 4} micro-batches,
  whose loss-token, document and indexer-token counts differ, give one step over the whole batch
  (`_assert_same_step`)."""
  steps, state, batch = accum_setup
  micro_tokens = np.asarray(batch["loss_mask"]).reshape(2, 2, -1).transpose(1, 0, 2).sum((1, 2))
  assert micro_tokens[0] != micro_tokens[1]   # the micro-batches differ in loss tokens
  ref_state, ref_m = steps[1](state, batch)
  assert bool(ref_m["finite"]) and float(ref_m["indexer_loss"]) > 0 and (
      float(ref_m["balance_loss"]) > 0)
  for k in (2, 4):
    new_state, m = steps[k](state, batch)
    _assert_same_step(state, new_state, ref_state, m, ref_m, k)


# --- weights cast once per step -----------------------------------------------------------------

@pytest.mark.slow  # three compiles of the tiny model's accumulated step (~1 min each on 2 cores)
def test_cast_weights_once_gives_the_same_step_bit_for_bit():
  """`ModelConfig.cast_weights_once` (the `CAST_ONCE` weights cast to bfloat16 once per step, not
  in each forward and remat pass) on the tiny model in bfloat16 with every CSA2 mode, Engram,
  routed and shared experts, layer remat and 2 micro-batches: the new state and the metrics equal
  the per-use casts' bit for bit. A listed weight that some path reads in float32 (planted: the
  compressor's `wkv`) changes the loss."""
  import dataclasses
  import re
  from dsv41_jax.model import init_model
  from dsv41_jax.param_paths import iter_params
  from launch import step as step_mod
  cfg = testing.tiny_config(dtype="bfloat16", remat=True)
  model = init_model(cfg, seed=0)
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  listed = [p for p, _ in iter_params(params) if step_mod.CAST_ONCE.match(p)]
  for kind in ("attn/wq_a", "attn/wo_b", "indexer/wk", "indexer/weights_proj", "experts/w1",
               "shared/w2", "engram/w_ekv"):
    assert any(p.endswith(kind) for p in listed), kind
  assert not any("compressor" in p or p.endswith("router") for p in listed)
  ocfg = OptimConfig(lr=3e-3, warmup_steps=0, decay_start=10, decay_end=20, schedule_unit="steps")
  tx = build_optimizer(ocfg, params, sub_tables=step_mod.engram_sub_tables(model))
  batch = testing.packed_batch(cfg, 3, batch_size=4, max_docs=3, pad_from=[None, 9, None, 20])
  state = TrainState(params, tx.init(params), jnp.zeros((cfg.num_hidden_layers, 2,
                                                         cfg.n_routed_experts), jnp.float32))
  run = lambda c: jax.jit(make_train_step(c, graphdef, tx, 0.01, 2))(state, batch)
  ref_state, ref_m = run(cfg)
  new_state, m = run(dataclasses.replace(cfg, cast_weights_once=True))
  assert bool(ref_m["finite"])
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new_state)[0],
                          jax.tree.leaves(ref_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  for name in ref_m:
    np.testing.assert_array_equal(np.asarray(m[name]), np.asarray(ref_m[name]), err_msg=name)
  planted = re.compile(step_mod.CAST_ONCE.pattern + r"|^.*/compressor/wkv$")
  original = step_mod.CAST_ONCE
  try:
    step_mod.CAST_ONCE = planted
    _, planted_m = run(dataclasses.replace(cfg, cast_weights_once=True))
  finally:
    step_mod.CAST_ONCE = original
  assert float(planted_m["loss"]) != float(ref_m["loss"])
