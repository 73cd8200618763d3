"""Optimizer state sharded exactly like its parameter on an 8-device CPU mesh (docs/design.md §T2)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dsv41_jax import sharding, testing
from optim import chain, table
from optim.config import OptimConfig, OptimConfigError

LAYER = "runs/0/core"
# (path, shape, logical axes): the model's names and axes, one leading stacked axis on layers.
PARAMS = [
    ("embed", (64, 16), ("vocab", "embed")),
    ("final_norm/scale", (16,), ("norm",)),
    (f"{LAYER}/attn/wq_b", (2, 8, 4, 6), (None, "q_lora", "heads", "head_dim")),
    (f"{LAYER}/moe/experts/w1", (2, 4, 16, 8), (None, "expert", "embed", "mlp")),
    (f"{LAYER}/attn_norm/scale", (2, 16), (None, "norm")),
    (f"{LAYER}/engram/table", (2, 32, 8), (None, "engram_rows", "engram_dim")),
]


def _nest(flat):
  out = {}
  for path, v in flat.items():
    *head, last = path.split("/")
    d = out
    for k in head:
      d = d.setdefault(k, {})
    d[last] = v
  return out


def _assert_like_params(state, shardings):
  by_path = dict(table.flatten_params(shardings))
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if leaf.ndim == 0:   # step counters
      assert leaf.sharding.is_fully_replicated
      continue
    path = table.path_str(keypath)
    owner = max((p for p in by_path if path.endswith("/" + p)), key=len)
    assert leaf.sharding.is_equivalent_to(by_path[owner], leaf.ndim), (path, leaf.sharding)


CFG = OptimConfig(lr=0.01, warmup_steps=0, decay_start=10, decay_end=20, schedule_unit="steps")


def _sharded(mesh, params_at, seed):
  """(shardings, host parameters, parameters, gradients) of (path, shape, logical axes) rows on
  `mesh`, random normal."""
  rng = np.random.default_rng(seed)
  spec = lambda axes, ndim: sharding.fit_spec(sharding.logical_to_mesh(axes, ndim), mesh)
  shardings = _nest({p: NamedSharding(mesh, spec(ax, len(s))) for p, s, ax in params_at})
  host = _nest({p: rng.standard_normal(s).astype(np.float32) for p, s, _ in params_at})
  grads = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), host)
  return shardings, host, jax.device_put(host, shardings), jax.device_put(grads, shardings)


def _assert_equals_unsharded(tx, host, grads, updates):
  """The sharded step's updates equal an unsharded, eager one."""
  host_params = jax.tree.map(jnp.asarray, host)
  ref, _ = tx.update(jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), grads),
                     tx.init(host_params), host_params)
  for (p, a), (_, b) in zip(table.flatten_params(updates), table.flatten_params(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-8, err_msg=p)


def test_state_sharded_like_params_at_init_and_after_update():
  mesh = testing.cpu_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
  shardings, host, params, grads = _sharded(mesh, PARAMS, 0)
  # The Engram table: two (prime-sized) hash tables and padding rows, as the model lays them out.
  tx = chain.build_optimizer(CFG, params, sub_tables={f"{LAYER}/engram/table": ((0, 13), (13, 17))})
  state = chain.init_opt_state(tx, params)

  # one buffer per parameter, two for the adamw leaves (final_norm, attn_norm); counters scalar
  assert sum(1 for x in jax.tree.leaves(state) if x.ndim > 0) == len(PARAMS) + 2
  _assert_like_params(state, shardings)

  state_sh = chain.opt_state_shardings(tx, params)
  step = jax.jit(tx.update, out_shardings=(shardings, state_sh))
  updates, new_state = step(grads, state, params)
  _assert_like_params(new_state, shardings)
  # the sharded step computes the same update as an unsharded, eager one
  _assert_equals_unsharded(tx, host, grads, updates)


def test_item_split_plan():
  """Where each mesh axis goes for Newton–Schulz: off the matrix axes (innermost first) onto the
  item axis with the most entries per device, then the unused mesh axes; a matrix axis that no
  item axis can take is gathered."""
  from jax.sharding import PartitionSpec as P
  from optim.muon import Move, item_split_plan
  sizes = {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
  # head-wise (layers, in, heads, head_dim): heads already split (2 a device), the matrices
  # (in, head_dim) whole; data goes to the layers (4 a device)
  assert item_split_plan((4, 32, 8, 16), P(None, None, ("tensor", "fsdp"), None), sizes, True) == (
      [Move("data", None, 0)], P("data", None, ("tensor", "fsdp"), None))
  # experts (layers, experts, in, out): fsdp off `in` to the experts (8 > 4), tensor off `out`
  # to the layers (4 = 4: the first), data to the experts (4 > 2)
  assert item_split_plan((4, 8, 32, 16), P(None, None, "fsdp", "tensor"), sizes, False) == (
      [Move("fsdp", 2, 1), Move("tensor", 3, 0), Move("data", None, 1)],
      P("tensor", ("fsdp", "data"), None, None))
  # one layer: nothing to split by, so the matrix axes are gathered and data stays replicated
  assert item_split_plan((1, 32, 16), P(None, "fsdp", "tensor"), sizes, False) == (
      [Move("fsdp", 1, None), Move("tensor", 2, None)], P(None, None, None))
  # an axis over two mesh axes moves innermost first
  assert item_split_plan((8, 32, 16), P(None, ("tensor", "fsdp"), None), sizes, False) == (
      [Move("fsdp", 1, 0), Move("tensor", 1, 0), Move("data", None, 0)],
      P(("fsdp", "tensor", "data"), None, None))


def test_muon_on_a_mesh_iterates_its_share_of_whole_matrices(capfd):
  """On data 2 × fsdp 2 × tensor 2 with the parameters' layouts known and the mesh in context,
  each device runs Newton–Schulz on 1/8 of the items, whole (no product batches more than 4
  matrices: 4 of the 32 of a head-wise and of an expert weight each, where XLA's own partitioning
  of the batches ran all 72 (32, 16) matrices on every device), with no "Involuntary full
  rematerialization", and
  the update equals the unsharded one; a one-layer weight (gathered) and one whose matrix axis is
split over two mesh axes too."""
  mesh = testing.cpu_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  params_at = [
      (f"{LAYER}/attn/wq_b", (4, 32, 8, 16), (None, "q_lora", "heads", "head_dim")),
      (f"{LAYER}/moe/experts/w1", (4, 8, 32, 16), (None, "expert", "embed", "mlp")),
      (f"{LAYER}/moe/shared/w2", (4, 32, 32), (None, "mlp", "embed")),
      (f"{LAYER}/moe/shared/w1", (1, 32, 24), (None, "embed", "mlp")),
      # a matrix axis over two mesh axes (tensor, fsdp), moved innermost first
      (f"{LAYER}/attn/wo_b", (8, 32, 16), (None, "heads", None)),
  ]
  shardings, host, params, grads = _sharded(mesh, params_at, 3)
  tx = chain.build_optimizer(CFG, params)
  state = chain.init_opt_state(tx, params)
  with jax.set_mesh(mesh):
    step = jax.jit(tx.update, out_shardings=(shardings, chain.opt_state_shardings(tx, params)))
    compiled = step.lower(grads, state, params).compile()
    updates, _ = compiled(grads, state, params)
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  # the most matrices one product of the program batches
  batch = lambda c: max(int(np.prod([int(n) for n in dims.split(",")[:-2]])) for dims in
                        re.findall(r"f32\[([0-9]+,[0-9]+,[0-9,]+)\]\{[0-9,]*\} dot\(", c.as_text()))
  assert batch(compiled) == 4
  # the control: `ns_split="xla"` (the batches as on one device, partitioned by XLA) has every
  # device iterate all 72 matrices of the (32, 16) batch (wq_b, experts/w1, wo_b)
  xla_tx = chain.build_optimizer(dataclasses.replace(CFG, ns_split="xla"), params)
  with jax.set_mesh(mesh):
    xla = jax.jit(xla_tx.update).lower(grads, state, params).compile()
  assert batch(xla) == 72
  with pytest.raises(OptimConfigError, match="ns_split must be 'items' or 'xla'"):
    OptimConfig(ns_split="heads")
  _assert_equals_unsharded(tx, host, grads, updates)
