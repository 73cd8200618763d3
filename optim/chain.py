"""The optimizer chain (docs/design.md §T2): one `optax.partition` over the table's three groups.

    check structure → zero frozen gradients → clip by global norm →
    partition{muon: Muon + wd, adamw: Adam + wd, sinkhorn: Sinkhorn momentum + wd} →
    × (−lr(step) · group multiplier · row multiplier), frozen parameters × 0

The schedule is data: `tx.update(grads, state, params, schedule=schedule_of(cfg))` reads the
peak rate and the boundaries from `schedule` (an `optim.schedule.Schedule`, traced when the step
is jitted), so one compiled step serves every `train.steps`; without it, the chain uses the
config's schedule as constants.

The clip's norm may come precomputed: `tx.update(..., grad_sq_sums=leaf_sq_sums(grads))` hands it
each gradient leaf's Σg², which the train step already sums for its `grad_norm` metric, so the
gradient is read once for both (`_clip_by_global_norm`); without it, the clip sums the gradient as
`optax.clip_by_global_norm` does, with the same result bit for bit.

With `OptimConfig.chain = "adamw"` (the ablation baseline) the muon and sinkhorn groups take Adam
too, each group keeping its weight decay, multipliers (Engram tables ×5 included) and schedule.

Trees: the optimizer works on the parameter tree the train step holds, either the pure state
`nnx.as_pure(nnx.state(model, nnx.Param))` (arrays at the leaves, what `nnx.Optimizer` passes to
`tx.update`), its `to_pure_dict()`, or any pytree of arrays; `init` also accepts the same tree with
`nnx.Param` leaves. Parameters are named by their '/'-joined path (see `optim.table`). The tree given
to `build_optimizer` may be abstract (`jax.ShapeDtypeStruct` leaves).

State: one buffer per parameter for muon and sinkhorn, two for adamw (two for every group with
chain="adamw"), plus a few step counters.
`init_opt_state` creates it under `jax.jit` with each buffer sharded exactly like its parameter.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from optim import table as table_lib
from optim.config import OptimConfig
from optim.muon import scale_by_muon
from optim.schedule import Schedule, boundaries, learning_rate, schedule_of
from optim.sinkhorn import scale_by_sinkhorn
from optim.table import TABLE, Row, TableError


# Parameters that stack several hash tables along their rows (the Engram tables, docs/design.md
# §7.2): the Muon chain balances each of their sub-tables on its own, so it must be told the layout.
STACKED_TABLES: tuple[str, ...] = ("**/engram/table",)


class StepState(NamedTuple):
  count: jax.Array


def _check_structure(template: Mapping[str, tuple[int, ...]]) -> optax.GradientTransformation:
  """Raise `TableError` naming every path whose presence or shape differs from the template."""

  def check(tree, what):
    got = {p: tuple(v.shape) for p, v in table_lib.flatten_params(tree)}
    missing = sorted(set(template) - set(got))
    extra = sorted(set(got) - set(template))
    shapes = sorted(f"{p} {got[p]} (parameter {template[p]})"
                    for p in set(got) & set(template) if got[p] != template[p])
    msgs = []
    if missing:
      msgs.append(f"{what} lacks parameters {missing}")
    if extra:
      msgs.append(f"{what} has entries that are no parameter {extra}")
    if shapes:
      msgs.append(f"{what} has shapes differing from the parameters: {shapes}")
    if msgs:
      raise TableError("; ".join(msgs))

  def init_fn(params):
    check(params, "the parameter tree given to init")
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    check(updates, "the gradient tree")
    if params is not None:
      check(params, "the parameter tree given to update")
    return updates, state

  return optax.GradientTransformation(init_fn, update_fn)


def _active(count, path: str, frozen: frozenset[str], unfreeze: bool, schedule: Schedule):
  """1 for trainable parameters, 0 for frozen ones (until the decay starts, if `unfreeze`)."""
  if path not in frozen:
    return jnp.float32(1.0)
  if not unfreeze:
    return jnp.float32(0.0)
  return (count.astype(jnp.float32) >= schedule.decay_start).astype(jnp.float32)


def _zero_frozen(cfg: OptimConfig, frozen: frozenset[str], unfreeze: bool
                 ) -> optax.GradientTransformationExtraArgs:
  """Zero the gradients of frozen parameters, so they move no momentum and no clipping norm."""

  def init_fn(params):
    del params
    return StepState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, schedule: Schedule | None = None, **extra):
    del params, extra
    sc = schedule_of(cfg) if schedule is None else schedule
    out = table_lib.map_params(
        lambda path, g: g * _active(state.count, path, frozen, unfreeze, sc).astype(g.dtype),
        updates)
    return out, StepState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _sq_sum(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.square(x))


def leaf_sq_sums(tree):
  """Σ x² of every leaf, a tree of float32 scalars like `tree`: the terms of `optax.tree.norm`,
  which `global_norm` adds in its order (so `global_norm(leaf_sq_sums(t))` is
  `optax.tree.norm(t)` bit for bit)."""
  return jax.tree.map(_sq_sum, tree)


def global_norm(sq_sums) -> jax.Array:
  """√(Σ of the leaves of `sq_sums`), summed leaf by leaf in tree order as `optax.tree.norm`."""
  return jnp.sqrt(jax.tree.reduce(operator.add, sq_sums, initializer=0))


def _clip_by_global_norm(max_norm: float, zeroed: frozenset[str]
                         ) -> optax.GradientTransformationExtraArgs:
  """`optax.clip_by_global_norm(max_norm)`, the same arithmetic, whose norm is summed from the
  extra argument `grad_sq_sums` when given: `leaf_sq_sums` of the gradient passed to `tx.update`.
  Every leaf reaches the clip as it was given (× 1) except those in `zeroed`, the frozen
  parameters, whose gradient `_zero_frozen` may have zeroed: their terms are summed again from the
  updates the clip receives (s3's ViT: 34 M of 2.19 B parameters). So the train step sums each
  gradient once for its `grad_norm` metric and the clip, where the clip used to sum it again. XLA
  merged the two sums while no parameter was frozen (the H200 s3 profile, which runs without
  frozen parameters, has no second sum: 0.005 ms at the `tx.update` line); with frozen ones the
  clip's sums of g·active were a second reduction of every gradient, a second read of it (at s3
  8.6 GB, ~2.1 ms) wherever XLA does not fuse the two reductions (the CPU's does)."""

  def update_fn(updates, state, params=None, *, grad_sq_sums=None, **extra):
    del params, extra
    if grad_sq_sums is None:
      sums = leaf_sq_sums(updates)
    else:
      given = dict(table_lib.flatten_params(grad_sq_sums))
      sums = table_lib.map_params(
          lambda path, u: _sq_sum(u) if path in zeroed else given[path], updates)
    g_norm = global_norm(sums)
    trigger = g_norm < max_norm
    clip = lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)
    return jax.tree.map(clip, updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _scale_by_lr(cfg: OptimConfig, multiplier: Mapping[str, float], frozen: frozenset[str],
                 unfreeze: bool) -> optax.GradientTransformationExtraArgs:
  """u ← −lr(step) · multiplier[path] · u; frozen parameters get 0 (no weight decay either).
  lr(step) follows the `schedule` extra argument, else the config's schedule."""

  def init_fn(params):
    del params
    return StepState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, schedule: Schedule | None = None, **extra):
    del params, extra
    sc = schedule_of(cfg) if schedule is None else schedule
    lr = learning_rate(sc, state.count)

    def leaf(path, u):
      scale = -lr * multiplier[path] * _active(state.count, path, frozen, unfreeze, sc)
      return (u * scale).astype(u.dtype)

    return table_lib.map_params(leaf, updates), StepState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _group_lr_mult(cfg: OptimConfig) -> dict[str, float]:
  return {"muon": cfg.muon_lr_mult, "adamw": cfg.adamw_lr_mult, "sinkhorn": cfg.sinkhorn_lr_mult}


def _row_lr_mult(cfg: OptimConfig, row: Row) -> float:
  """The row's own multiplier; rows tagged "vision" also take `cfg.vision_lr_mult`."""
  return row.lr_mult * (cfg.vision_lr_mult if row.tag == "vision" else 1.0)


def frozen_trainable(cfg: OptimConfig, step: int) -> bool:
  """Whether the `frozen` parameters train at `step` (the model's static `train_vit` switch)."""
  if cfg.unfreeze_at == "never":
    return False
  return step >= boundaries(cfg).decay_start


def build_optimizer(cfg: OptimConfig, params, table: Sequence[Row] = TABLE,
                    sub_tables: Mapping[str, Sequence[tuple[int, int]]] | None = None,
                    param_shardings=None) -> optax.GradientTransformation:
  """The full chain for this parameter tree (arrays, ShapeDtypeStructs or nnx.Params at leaves).

  `sub_tables` maps the path of a sinkhorn-group parameter that stacks several tables along its
  rows (an Engram table, docs/design.md §7.2) to their ((offset, rows), ...): each is balanced on its own
  (docs/design.md §T2) and the rows in none of them stay untouched. With the Muon chain every
  Engram table (`STACKED_TABLES`) needs an entry: the model's layout is
  `launch.step.engram_sub_tables(model)`; one block `((0, rows),)` balances a table whole.

  `param_shardings` (a tree like `params`; default: the leaves' own `.sharding`, where they have
  one) gives Muon each parameter's layout, so that on a mesh Newton–Schulz runs on whole matrices
  split by items over the devices (optim/muon.py; `cfg.ns_split`); without layouts it runs as XLA
  partitions it.

  Raises `TableError` naming every parameter claimed by no row or by several, every frozen
  pattern that matches nothing, every bad `sub_tables` entry and every Engram table without one.
  """
  rows = table_lib.label_params(params, table)
  template = {p: tuple(v.shape) for p, v in table_lib.flatten_params(params)}
  sub_tables = table_lib.check_sub_tables(sub_tables or {}, rows, template)
  unlaid = sorted(p for p, r in rows.items() if r.group == "sinkhorn" and p not in sub_tables
                  and table_lib.matches_any(p, STACKED_TABLES))
  if cfg.chain == "muon" and unlaid:
    raise TableError(
        f"build_optimizer: sub_tables gives no layout for the Engram tables {unlaid}; Sinkhorn "
        "balances each (order, head) hash table on its own (docs/design.md §T2): pass "
        "sub_tables=launch.step.engram_sub_tables(model), or ((0, rows),) to balance one whole")
  if cfg.frozen:
    table_lib.check_patterns_used(cfg.frozen, params, "frozen")
  frozen = frozenset(p for p in rows if table_lib.matches_any(p, cfg.frozen))
  unfreeze = cfg.unfreeze_at == "decay_start"
  group_mult = _group_lr_mult(cfg)
  multiplier = {p: group_mult[r.group] * _row_lr_mult(cfg, r) for p, r in rows.items()}
  if param_shardings is None:
    param_shardings = table_lib.map_params(lambda _, v: getattr(v, "sharding", None), params)
  specs = {p: s.spec for p, s in table_lib.flatten_params(param_shardings)
           if isinstance(s, NamedSharding) and cfg.ns_split == "items"}

  def labels(tree):
    return table_lib.map_params(lambda path, _: rows[path].group, tree)

  def adamw(weight_decay):
    return optax.chain(optax.scale_by_adam(b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps),
                       optax.add_decayed_weights(weight_decay))

  if cfg.chain == "muon":
    groups = {
        "muon": optax.chain(
            scale_by_muon(cfg.muon_momentum, cfg.update_rms, lambda path: rows[path].headwise,
                          cfg.newton_schulz, frozen=lambda path: path in frozen,
                          ns_schedule=cfg.ns_schedule, spec=specs.get),
            optax.add_decayed_weights(cfg.weight_decay)),
        "adamw": adamw(cfg.weight_decay),
        "sinkhorn": optax.chain(
            scale_by_sinkhorn(cfg.sinkhorn_momentum, cfg.sinkhorn_iters, cfg.sinkhorn_tau,
                              cfg.sinkhorn_eps, cfg.update_rms, sub_tables,
                              cfg.sinkhorn_stat_dtype),
            optax.add_decayed_weights(cfg.sinkhorn_weight_decay)),
    }
  else:  # "adamw": the groups keep their weight decay and learning-rate multipliers
    groups = {"muon": adamw(cfg.weight_decay), "adamw": adamw(cfg.weight_decay),
              "sinkhorn": adamw(cfg.sinkhorn_weight_decay)}
  parts = [_check_structure(template)]
  if frozen:
    parts.append(_zero_frozen(cfg, frozen, unfreeze))
  if cfg.clip_norm > 0:
    parts.append(_clip_by_global_norm(cfg.clip_norm, frozen))
  parts.append(optax.partition(groups, labels))
  parts.append(_scale_by_lr(cfg, multiplier, frozen, unfreeze))
  return optax.chain(*parts)


def learning_rates(cfg: OptimConfig, step: int, table: Sequence[Row] = TABLE) -> dict[str, float]:
  """Learning rate of each group at `step`, plus one entry per tagged row (e.g. engram_table)."""
  lr = float(learning_rate(cfg, step))
  group_mult = _group_lr_mult(cfg)
  out = {g: lr * m for g, m in group_mult.items()}
  for r in table:
    if r.tag is not None:
      out[r.tag] = lr * group_mult[r.group] * _row_lr_mult(cfg, r)
  return out


# --- sharding of the state --------------------------------------------------------------------

def _components(keypath) -> list[str]:
  return table_lib.path_str(keypath).split("/") if keypath else []


def opt_state_shardings(tx: optax.GradientTransformation, params, param_shardings=None):
  """A tree of shardings for `tx.init(params)`: each buffer takes its parameter's sharding (the
  parameter whose path ends the buffer's path, shapes equal); counters are replicated.

  `param_shardings` defaults to the `.sharding` of the parameter leaves.
  """
  if param_shardings is None:
    param_shardings = table_lib.map_params(lambda _, v: v.sharding, params)
  by_path = {p: s for p, s in table_lib.flatten_params(param_shardings)}
  shapes = {p: tuple(v.shape) for p, v in table_lib.flatten_params(params)}
  meshes = {s.mesh for s in by_path.values() if isinstance(s, NamedSharding)}
  if len(meshes) != 1:
    raise ValueError(f"parameters must be NamedSharding-ed over one mesh (found {len(meshes)})")
  replicated = NamedSharding(meshes.pop(), P())
  abstract = jax.eval_shape(tx.init, params)

  def pick(keypath, leaf):
    names = _components(keypath)
    for k in range(len(names)):
      path = "/".join(names[k:])
      if path in by_path and shapes[path] == tuple(leaf.shape):
        return by_path[path]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract)


def init_opt_state(tx: optax.GradientTransformation, params, param_shardings=None) -> Any:
  """`tx.init(params)` under jit, every buffer created with its parameter's sharding."""
  shardings = opt_state_shardings(tx, params, param_shardings)
  return jax.jit(tx.init, out_shardings=shardings)(params)
