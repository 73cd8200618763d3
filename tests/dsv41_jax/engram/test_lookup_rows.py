"""Engram gradients as rows (dsv41_jax/engram/lookup.py): the row exchange trains a table exactly
like the dense gradient, and the compiled step holds no table-shaped gradient buffer.

Reference: the gradient written densely in float64 numpy, g = onehotᵀ(ids) · cotangent (every row
of the table, touched or not), fed to the same Sinkhorn-balanced momentum (optim/sinkhorn.py, per
sub-table block) without any mesh.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dsv41_jax import sharding, testing
from dsv41_jax.engram import lookup
from optim.chain import init_opt_state
from optim.sinkhorn import scale_by_sinkhorn

R, D = 2048, 8
BLOCKS = ((0, 601), (601, 997), (1598, 401))      # three prime-sized sub-tables, padding after
LR = 0.05


def _tx():
  return scale_by_sinkhorn(0.95, 11, 1e-3, 1e-20, 0.18, {"table": BLOCKS})


def _problem(steps, batch, seed=0):
  rng = np.random.default_rng(seed)
  table = rng.normal(size=(R, D)).astype(np.float32)
  table[1998:] = 0.0                                                # padding rows
  starts = np.array([o for o, _ in BLOCKS])
  sizes = np.array([n for _, n in BLOCKS])
  ids, cots = [], []
  for _ in range(steps):
    h = rng.integers(0, 3, size=(batch, 5, 3))
    i = starts[h] + rng.integers(0, 10 ** 6, size=h.shape) % sizes[h]
    i[0, :2] = i[0, 0, 0]                                          # repeated rows in one step
    ids.append(i.astype(np.int32))
    cots.append(rng.normal(size=(batch, 5, 3, D)).astype(np.float32))
  return table, ids, cots


def _dense_run(table, ids, cots):
  tx = _tx()
  params = {"table": jnp.asarray(table)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i, c in zip(ids, cots):
    g = np.zeros((R, D), np.float64)
    np.add.at(g, i.reshape(-1), c.reshape(-1, D).astype(np.float64))
    u, state = update({"table": jnp.asarray(g, jnp.float32)}, state)
    params = jax.tree.map(lambda p, v: p - LR * v, params, u)
  return np.asarray(params["table"])


def _step_fn(tx):
  def step(params, state, ids, cot):
    g = jax.grad(lambda p: jnp.sum(lookup.engram_lookup(p["table"], ids) * cot))(params)
    u, state = tx.update(g, state)
    return jax.tree.map(lambda p, v: p - LR * v, params, u), state
  return step


def _row_shardings(mesh):
  spec = sharding.fit_spec(sharding.logical_to_mesh(("engram_rows", "engram_dim")), mesh)
  return NamedSharding(mesh, spec)


@pytest.mark.parametrize("mesh_shape", [{"engram": 1}, {"engram": 2, "data": 2}])
def test_row_exchange_trains_like_the_dense_gradient(mesh_shape):
  steps, batch = 3, 4
  table, ids, cots = _problem(steps, batch)
  want = _dense_run(table, ids, cots)
  mesh = testing.cpu_mesh(mesh_shape)
  tx = _tx()
  with jax.set_mesh(mesh):
    params = {"table": jax.device_put(jnp.asarray(table), _row_shardings(mesh))}
    state = init_opt_state(tx, params)
    step = jax.jit(_step_fn(tx))
    bs = sharding.batch_sharding(mesh, 3)
    for i, c in zip(ids, cots):
      params, state = step(params, state, jax.device_put(jnp.asarray(i), bs),
                           jax.device_put(jnp.asarray(c), sharding.batch_sharding(mesh, 4)))
  got = np.asarray(params["table"])
  assert not np.allclose(got, table)                                 # it trained
  np.testing.assert_array_equal(got[1998:], 0.0)                     # padding untouched
  # Float32 throughout; the only difference from the reference is the order in which repeated
  # rows' gradients are summed (and float64 vs float32 there): a few ulps of LR·0.18-sized steps.
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_many_rounds_when_one_owner_gets_every_id():
  """Every id of every device in owner 0's block: more ids per owner than one round carries;
  the rounds still return every row and every gradient exactly."""
  mesh = testing.cpu_mesh({"engram": 4, "data": 2})
  rng = np.random.default_rng(5)
  table = jnp.asarray(rng.normal(size=(R, D)), jnp.float32)
  ids = jnp.asarray(rng.permutation(R // 8)[:8 * 7 * 3].reshape(8, 7, 3), jnp.int32)
  n_local = 7 * 3
  assert n_local > lookup.exchange_capacity(n_local, 8)                # > 1 round needed
  cot = jnp.asarray(rng.normal(size=(8, 7, 3, D)), jnp.float32)
  with jax.set_mesh(mesh):
    t = jax.device_put(table, _row_shardings(mesh))
    i = jax.device_put(ids, sharding.batch_sharding(mesh, 3))
    v, vjp = jax.vjp(lambda tt: lookup.engram_lookup(tt, i), t)
    g = vjp(cot)[0]
  np.testing.assert_array_equal(np.asarray(v), np.asarray(table)[np.asarray(ids)])
  g_ref = np.zeros((R, D), np.float32)
  np.add.at(g_ref, np.asarray(ids).reshape(-1), np.asarray(cot).reshape(-1, D))
  np.testing.assert_array_equal(np.asarray(g), g_ref)                 # distinct ids: no sums


def test_compiled_step_holds_no_table_shaped_gradient():
  """The compiled lookup + backward + Sinkhorn update on 4 devices: no [R, D] buffer anywhere,
  and no collective on a table shard ([R/4, D]) or anything larger (the former design's
  data-parallel all-reduce of a [R/2, D] engram shard); rows and gradients move by all-to-all."""
  mesh = testing.cpu_mesh({"engram": 2, "data": 2})
  table, ids, cots = _problem(1, 4)
  tx = _tx()
  with jax.set_mesh(mesh):
    params = {"table": jax.device_put(jnp.asarray(table), _row_shardings(mesh))}
    state = init_opt_state(tx, params)
    args = (params, state, jax.device_put(jnp.asarray(ids[0]), sharding.batch_sharding(mesh, 3)),
            jax.device_put(jnp.asarray(cots[0]), sharding.batch_sharding(mesh, 4)))
    hlo = jax.jit(_step_fn(tx)).lower(*args).compile().as_text()
  counts = testing.count_collectives(hlo)
  # Row ids and row gradients to their owners (the forward's rows are dead code here: the loss is
  # linear in them); the all-reduces are the rounds' pmax and Sinkhorn's per-block statistics.
  assert counts["all-to-all"] >= 2, counts
  assert re.search(rf"\[{R},{D}\]", hlo) is None       # nothing table-shaped in the whole step
  # A collective whose every replica group is one device moves nothing (shard_map's transpose
  # sums the table's gradient over the size-1 axes it is replicated on; XLA drops such sums).
  for line in hlo.splitlines():
    # the instruction's own opcode, not an operand named after one (%all-reduce.2)
    if re.search(r" (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
                 r"(-start)?\(", line):
      if not testing.single_device_groups(line):
        rows = [int(r) for r in re.findall(rf"\[(\d+),{D}\]", line)]
        assert all(r < R // 4 for r in rows), line      # no table shard (or more) crosses devices
