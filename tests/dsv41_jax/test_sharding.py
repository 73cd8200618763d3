"""dsv41_jax/sharding.py: the rules table claims every parameter once, bad tables and meshes are
errors naming the culprit, a run can swap the whole table, and the collectives of the compiled MoE
and of a dense block on an 8-device CPU mesh are pinned (a sharding regression fails loudly), as is
the absence of a full rematerialization from the embedding's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv41_jax import model as model_lib, sharding, testing
from dsv41_jax.layers import moe, moe_dispatch


def _tiny_state():
  cfg = testing.tiny_config(vision=testing.tiny_vision_config())
  return nnx.state(model_lib.abstract_model(cfg), nnx.Param)


def test_every_parameter_is_claimed_and_no_mesh_axis_twice():
  specs = sharding.state_partition_specs(_tiny_state())
  for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
    used = [a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))]
    assert len(used) == len(set(used)), spec


def test_unmatched_logical_axis_names_the_parameter():
  rules = dict(sharding.RULES)
  del rules["q_lora"]
  with pytest.raises(sharding.ShardingError, match=r"'[^']*attn/wq_a'.*'q_lora' has no entry"):
    sharding.state_partition_specs(_tiny_state(), rules)


def test_axis_mapped_twice_names_the_parameter():
  rules = {**sharding.RULES, "q_lora": "fsdp"}            # wq_a is ("embed", "q_lora")
  with pytest.raises(sharding.ShardingError,
                     match=r"wq_a'.*mesh axis 'fsdp' is mapped twice, by 'embed' and 'q_lora'"):
    sharding.state_partition_specs(_tiny_state(), rules)
  with pytest.raises(sharding.ShardingError, match="names a mesh axis twice"):
    sharding.check_table({**sharding.RULES, "embed": ("fsdp", "fsdp")})
  with pytest.raises(sharding.ShardingError, match="unknown mesh axes"):
    sharding.check_table({**sharding.RULES, "embed": "rows"})


def test_mesh_that_cannot_divide_names_dimension_and_axis():
  state = _tiny_state()                                   # hidden 32: embed over fsdp
  sharding.state_shardings(state, testing.cpu_mesh({"fsdp": 2, "tensor": 2}))   # fits
  with pytest.raises(sharding.ShardingError,
                     match=r"parameter '[^']+': dimension \d \(size 32\) does not split over mesh axes "
                           r"\('fsdp',\) \(3 ways\)"):
    sharding.state_shardings(state, testing.cpu_mesh({"fsdp": 3}))
  with pytest.raises(sharding.ShardingError, match=r"global batch 6 .* \(4 ways\)"):
    sharding.check_batch(6, testing.cpu_mesh({"data": 2, "engram": 2}))


def test_use_rules_swaps_activation_layouts_and_helpers():
  mesh = testing.cpu_mesh({"data": 2, "fsdp": 4})
  f = lambda x: sharding.constrain(x * 2, ("batch", "embed"))
  x = jnp.ones((8, 16))
  with jax.set_mesh(mesh):
    default = jax.jit(f)(x).sharding.spec
    with sharding.use_rules({**sharding.RULES, "batch": "data", "embed": "fsdp"}):
      swapped = jax.jit(lambda x: f(x))(x).sharding.spec
      assert sharding.batch_spec(mesh, 2) == P("data", None)
    assert sharding.batch_spec(mesh, 2) == P(("data", "fsdp"), None)
  pad = lambda spec: tuple(spec) + (None,) * (2 - len(spec))
  assert pad(default) == (("data", "fsdp"), None)        # embed stays unsplit: fsdp is taken
  assert pad(swapped) == ("data", "fsdp")
  assert sharding.batch_ways({"data": 2, "fsdp": 4, "tensor": 2}) == 8
  assert sharding.mesh_axes({"engram": 2, "data": 2, "fsdp": 1}, "engram_rows") == (
      "engram", "data")
  # `first`: the embedding's looked-up rows keep the table's split of embed; the batch the rest
  assert sharding.logical_to_mesh(("batch", "seq", "embed"), first=("embed",)) == P(
      ("data", "expert", "engram"), None, "fsdp")


# --- collectives of compiled steps (forward + backward) ----------------------------------------

def _grad_step(fn):
  return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=tuple(range(4))))


def test_moe_dispatch_collectives_pinned():
  """Dropless expert-parallel dispatch on data 2 × expert 4: tokens travel by all-to-all only
  (rows, expert ids, weights out and rows back forward; the transposes of the two row exchanges
  backward); no weight is gathered; one all-reduce sums the expert-weight gradients over the data
  replicas."""
  mesh = testing.cpu_mesh({"data": 2, "expert": 4})
  rng = np.random.default_rng(0)
  B, T, D, F, E, K = 8, 4, 16, 8, 8, 2
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  w = jnp.asarray(rng.uniform(size=(B, T, K)), jnp.float32)
  e = jnp.asarray(np.argsort(rng.uniform(size=(B, T, E)), -1)[..., :K], jnp.int32)
  valid = jnp.ones((B, T), bool)
  w1, w3 = (jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32) for _ in range(2))
  w2 = jnp.asarray(rng.normal(size=(E, F, D)), jnp.float32)

  def fn(x, w1, w3, w2):
    return moe_dispatch.routed_experts(x, w, e, valid, w1, w3, w2, mode="dropless")[0]

  bs = sharding.batch_sharding(mesh, 3)
  ws = jax.sharding.NamedSharding(mesh, sharding.fit_spec(
      sharding.logical_to_mesh(("expert", "embed", "mlp")), mesh))
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, s) for a, s in ((x, bs), (w1, ws), (w3, ws), (w2, ws))]
    counts = testing.count_collectives(_grad_step(fn).lower(*args).compile())
  assert counts == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 6,
                    "collective-permute": 0}, counts


def test_embedding_gradient_is_not_fully_rematerialized(capfd):
  """The token embedding's gradient on data 4 × fsdp 2, summed over micro-batches as the train
  step sums it: the scatter-add into the table (model width over fsdp) takes rows split on d,
  which XLA's SPMD partitioner cannot reach from the hidden state's layout (batch over data ×
  fsdp) but by replicating the whole cotangent and slicing it again. It reports that only as a
  log line ("Involuntary full rematerialization"); the control shows the capture sees it."""
  flag = "Involuntary full rematerialization"
  cfg = testing.tiny_config(dtype="bfloat16")
  mesh = testing.cpu_mesh({"data": 4, "fsdp": 2})
  gdef, params = nnx.split(model_lib.abstract_model(cfg))
  shardings = nnx.as_pure(sharding.state_shardings(params, mesh))
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nnx.as_pure(params), shardings)

  def grad_sum(params, tokens_KxBxT):
    loss = lambda p, t: jnp.sum(nnx.merge(gdef, p).embed_tokens(t).astype(jnp.float32) ** 2)
    zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(
        jnp.zeros(p.shape, p.dtype), s), params, shardings)
    step = lambda acc, t: (jax.tree.map(jnp.add, acc, jax.grad(loss)(params, t)), None)
    return jax.lax.scan(step, zeros, tokens_KxBxT)[0]

  with jax.set_mesh(mesh):
    tokens = jax.ShapeDtypeStruct((2, 8, cfg.seq_len), jnp.int32, sharding=jax.NamedSharding(
        mesh, P(None, *sharding.batch_spec(mesh))))
    jax.jit(grad_sum, out_shardings=shardings).lower(params, tokens).compile()
    assert flag not in capfd.readouterr().err
    rows = jax.ShapeDtypeStruct((8, cfg.seq_len, cfg.hidden_size), jnp.float32,
                                sharding=sharding.batch_sharding(mesh, 3))
    jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, P(None, None, "fsdp")) * 3).lower(
        rows).compile()
    assert flag in capfd.readouterr().err


def test_dense_block_collectives_pinned():
  """A shared-expert SwiGLU (embed over fsdp, mlp over tensor) on data 2 × fsdp 2 × tensor 2:
  ZeRO-3 gathers of the weights over fsdp, the row-parallel sum over tensor, gradients summed
  over the data and fsdp replicas."""
  mesh = testing.cpu_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  block = moe.SharedExpert(16, 8, 10.0, nnx.Rngs(0), jnp.float32)
  gdef, state = nnx.split(block)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 4, 16)), jnp.float32)

  def fn(x, w1, w3, w2):
    st = nnx.State({"w1": w1, "w3": w3, "w2": w2})
    return sharding.constrain(nnx.merge(gdef, st)(x), ("batch", "seq", "embed"))

  with jax.set_mesh(mesh):
    sh = nnx.as_pure(sharding.state_shardings(state, mesh))
    ws = [jax.device_put(state[k][...], sh[k]) for k in ("w1", "w3", "w2")]
    xs = jax.device_put(x, sharding.batch_sharding(mesh, 3))
    counts = testing.count_collectives(_grad_step(fn).lower(xs, *ws).compile())
  # 3 gathers (each weight once, reused by the backward), 3 all-reduces (the tensor sum of the
  # forward, of the backward's input gradient, and the weight gradients over data × fsdp, which
  # XLA on CPU combines and does not turn into reduce-scatters).
  assert counts == {"all-reduce": 3, "all-gather": 3, "reduce-scatter": 0, "all-to-all": 0,
                    "collective-permute": 0}, counts
