"""launch/step.py: a step whose loss or gradients are not finite applies nothing, even though every
parameter is finite (docs/design.md §T2, §T6); the evaluation step's sums against float64.

The step is generic in the model: it merges the graphdef it is given and reads the model's call
interface (`(logits, aux)` from `(inputs, moe_bias, train_vit=...)`). A toy module with that
interface makes the two cases exact and cheap to compile:
* a NaN injected into the gradient of one leaf (`w`) while the loss stays finite;
* an infinite loss from one row: finite logits ±3e38 whose cross-entropy overflows float32.
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
  return all(np.array_equal(np.asarray(x), np.asarray(y))
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
  from tests.launch import micro_config

  mcfg = model_config(micro_config.get_config())
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
