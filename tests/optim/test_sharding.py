"""Optimizer state sharded exactly like its parameter on an 8-device CPU mesh (docs/design.md §T2)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dsv41_jax import sharding, testing
from optim import chain, table
from optim.config import OptimConfig

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


def test_state_sharded_like_params_at_init_and_after_update():
  mesh = testing.cpu_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
  rng = np.random.default_rng(0)
  spec = lambda axes, ndim: sharding.fit_spec(sharding.logical_to_mesh(axes, ndim), mesh)
  shardings = _nest({p: NamedSharding(mesh, spec(ax, len(s))) for p, s, ax in PARAMS})
  host = _nest({p: rng.standard_normal(s).astype(np.float32) for p, s, _ in PARAMS})
  params = jax.device_put(host, shardings)
  grads = jax.device_put(jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32),
                                      host), shardings)
  cfg = OptimConfig(lr=0.01, warmup_steps=0, decay_start=10, decay_end=20, schedule_unit="steps")
  # The Engram table: two (prime-sized) hash tables and padding rows, as the model lays them out.
  tx = chain.build_optimizer(cfg, params, sub_tables={f"{LAYER}/engram/table": ((0, 13), (13, 17))})
  state = chain.init_opt_state(tx, params)

  # one buffer per parameter, two for the adamw leaves (final_norm, attn_norm); counters scalar
  assert sum(1 for x in jax.tree.leaves(state) if x.ndim > 0) == len(PARAMS) + 2
  _assert_like_params(state, shardings)

  state_sh = chain.opt_state_shardings(tx, params)
  step = jax.jit(tx.update, out_shardings=(shardings, state_sh))
  updates, new_state = step(grads, state, params)
  _assert_like_params(new_state, shardings)
  # the sharded step computes the same update as an unsharded, eager one
  host_params = jax.tree.map(jnp.asarray, host)
  ref, _ = tx.update(jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), grads),
                     tx.init(host_params), host_params)
  for (p, a), (_, b) in zip(table.flatten_params(updates), table.flatten_params(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-8, err_msg=p)
