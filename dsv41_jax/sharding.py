"""Logical axis names, the one table that maps them onto the mesh, and the partitioning helpers
(docs/design.md §T1). Every other module asks this one how an array is split.

Every parameter is created through `param(...)` with a tuple of logical axis names, stored as the
`logical_axes` metadata of its `nnx.Param`. `logical_to_mesh` turns those names into a
`PartitionSpec` with the *active* rules table: `RULES` unless a run swaps the whole table with
`use_rules(...)` (the memory plan's `--rules` what-if does), which then changes the parameter
shardings and the activation constraints (`constrain`, the MoE and Engram shard_maps) alike.
Parameters stacked by the layer scan carry extra leading axes that are never split.

Why these rules (the memory plan, `python -m launch.aot --config=configs/flash.py
--mesh=fsdp:8,expert:8,engram:8 --seq=4096 --analytic`, per device of 512; RESULTS.md):
- Engram table rows over `engram` *and* the batch axes (`engram_rows`): the 196.6 B table rows
  (92 GiB per device over `engram` alone) are split over every device, 1.4 GiB per device, and the
  lookup exchanges row ids and rows with their owners (`dsv41_jax.engram.lookup`), so the table
  gradient is the owner's rows only: no replica holds a copy to all-reduce.
- Dense weights over `fsdp` on the model width (ZeRO-3). Matrices without a model-width axis take
  `fsdp` on another axis: attention heads (`wq_b`, `attn_sink`) over `tensor` then `fsdp`, the
  indexer's `wq_b` over its head width (`index_dim`), the grouped output projection `wo_a` over
  its per-group input (`o_in`), the Engram projection over its input (`engram_in`), ViT and
  projector widths over `fsdp`. (`wq_b` and `wo_a` unsplit were 11 GiB per device at Flash size.)
- Routed experts over `expert` and `engram` (experts) × `fsdp` (model width): 384 experts in 40
  layers, 543 B parameters; over `expert` × `fsdp` alone (64 ways) they are 32 GiB per device.
- The batch over `data`, `fsdp`, `expert`, `engram`; heads and MLP width over `tensor`.
A mesh axis is used at most once per parameter (`state_partition_specs` names a parameter that
breaks that; `check_table` checks a table on its own);
an activation's later logical axis whose mesh axis is taken (e.g. `embed` after `batch` took
`fsdp`) stays unsplit, which is what makes the dense weights ZeRO-3: gathered for the matmul.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsv41_jax.param_paths import path_str

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "engram", "tensor")
BATCH = ("data", "fsdp", "expert", "engram")

Rules = Mapping[str, "str | tuple[str, ...] | None"]

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
RULES: Rules = {
    # activations
    "batch": BATCH,
    "seq": None,
    # dense weights: ZeRO-3 over fsdp on the model width, heads / MLP width over tensor
    "embed": "fsdp",
    "vocab": "tensor",
    "q_lora": None,
    "heads": ("tensor", "fsdp"),
    "head_dim": None,
    "kv": None,
    "o_groups": "tensor",
    "o_lora": None,
    "o_in": "fsdp",
    "o_cat": "tensor",  # wo_b input, the G·O concatenated group outputs: row-parallel
    "mlp": "tensor",
    "index_heads": None,
    "index_dim": "fsdp",  # the indexer's wq_b has no model-width axis; weights_proj has embed
    # MoE: experts over `expert`, and `engram` when a mesh has one (its devices hold other batch
    # shards; at Flash size on fsdp 8 × expert 8 × engram 8 experts over `expert` alone are 32 GiB
    # of weights per device)
    "expert": ("expert", "engram"),
    "expert_router": None,
    # mHC coefficients and other small axes
    "hc": None,
    "hc_mix": None,
    "norm": None,
    # Engram: rows over every axis that holds a different batch shard, so each device owns its rows
    "engram_rows": ("engram",) + tuple(a for a in BATCH if a != "engram"),
    "engram_dim": None,
    "engram_in": "fsdp",
    "engram_out": "tensor",
    # vision
    "vit_embed": "fsdp",
    "vit_mlp": "tensor",
    "vit_heads": "tensor",  # ViT q/k/v output and wo input: heads flattened with head_dim
    "patch": None,
    "proj_in": "fsdp",  # projector input: u² concatenated ViT features
    "proj_mlp": "tensor",
}


class ShardingError(ValueError):
  """A rules table, parameter or mesh that cannot be partitioned; the message names the culprit."""


# --- the active rules table ----------------------------------------------------------------------

_ACTIVE: list[Rules] = []


def active_rules() -> Rules:
  """The rules table in force: the innermost `use_rules`, else `RULES`."""
  return _ACTIVE[-1] if _ACTIVE else RULES


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[Rules]:
  """Swap the whole rules table while tracing (parameter shardings, activation constraints, MoE
  and Engram shard_maps). A jitted function traced under one table keeps it: build the step inside
  the context, as `launch.aot` does."""
  rules = check_table(rules)
  _ACTIVE.append(rules)
  try:
    yield rules
  finally:
    _ACTIVE.pop()


def _targets(entry) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def check_table(rules: Rules) -> dict:
  """The table as a dict, after checking every target is a mesh axis named once per entry."""
  out = {}
  for name, entry in rules.items():
    t = _targets(entry)
    bad = [a for a in t if a not in MESH_AXES]
    if bad:
      raise ShardingError(f"sharding rule {name!r} -> {entry!r}: unknown mesh axes {bad}; the "
                          f"mesh axes are {MESH_AXES}")
    if len(set(t)) != len(t):
      raise ShardingError(f"sharding rule {name!r} -> {entry!r} names a mesh axis twice")
    out[name] = None if not t else (t[0] if len(t) == 1 else t)
  return out


def _rules(rules: Rules | None) -> Rules:
  return active_rules() if rules is None else rules


def logical_to_mesh(axes: Sequence[str | None], ndim: int | None = None,
                    rules: Rules | None = None, *, strict: bool = False,
                    name: str | None = None, first: Sequence[str] = ()) -> P:
  """PartitionSpec for logical `axes`; extra leading dims (scan-stacked layers) are replicated.

  A mesh axis is used at most once per spec. For activations (`strict=False`) a later logical
  axis whose mesh axis is taken stays unsplit on it; for parameters (`strict=True`) that is a
  `ShardingError` naming the parameter `name`, and so is a logical axis the rules lack. The
  logical axes named in `first` take their mesh axes before the others do (an activation that
  keeps a parameter's split: `embed` before `batch` leaves the batch the other batch axes).
  """
  rules = _rules(rules)
  axes = tuple(axes)
  what = f"parameter {name!r}" if name else "array"
  if ndim is not None and ndim < len(axes):
    raise ShardingError(f"{what} of rank {ndim} cannot carry logical axes {axes}")
  used: dict[str, str] = {}
  out: list = [None] * len(axes)
  for i in sorted(range(len(axes)), key=lambda i: axes[i] not in first):
    logical = axes[i]
    if logical is None:
      continue
    if logical not in rules:
      raise ShardingError(f"{what}: logical axis {logical!r} has no entry in the sharding rules")
    targets = _targets(rules[logical])
    if strict:
      twice = [t for t in targets if t in used]
      if twice:
        raise ShardingError(f"{what} with logical axes {axes}: mesh axis {twice[0]!r} is mapped "
                            f"twice, by {used[twice[0]]!r} and {logical!r}")
    free = tuple(t for t in targets if t not in used)
    used.update({t: logical for t in free})
    out[i] = free[0] if len(free) == 1 else (free or None)
  lead = [] if ndim is None else [None] * (ndim - len(axes))
  return P(*lead, *out)


def param_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
  meta = variable.get_metadata()
  if "logical_axes" not in meta:
    raise ShardingError(f"parameter of shape {variable.shape} was created without logical_axes")
  return tuple(meta["logical_axes"])


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_partition_specs(state, rules: Rules | None = None):
  """Map an `nnx.State` of Params to a pytree (same structure) of PartitionSpecs.

  Raises `ShardingError` naming the parameter whose logical axis the rules lack, or whose axes
  map one mesh axis twice.
  """
  rules = _rules(rules)

  def spec(keypath, v):
    if isinstance(v, nnx.Variable):
      ndim = v.ndim if hasattr(v, "ndim") else len(v.shape)
      return v.replace(logical_to_mesh(param_axes(v), ndim, rules, strict=True,
                                       name=path_str(keypath)))
    return P()
  return jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_var)


def state_shardings(state, mesh: Mesh, rules: Rules | None = None):
  """NamedShardings for every leaf of an `nnx.State`, dropping mesh axes the mesh lacks; a
  dimension the mesh cannot divide is a `ShardingError` naming parameter, dimension and axis."""
  rules = _rules(rules)
  sizes = dict(mesh.shape)

  def one(keypath, v):
    if not isinstance(v, nnx.Variable):
      return NamedSharding(mesh, P())
    name = path_str(keypath)
    ndim = v.ndim if hasattr(v, "ndim") else len(v.shape)
    s = fit_spec(logical_to_mesh(param_axes(v), ndim, rules, strict=True, name=name), mesh)
    check_divisible(tuple(v.shape), s, sizes, name)
    return v.replace(NamedSharding(mesh, s))

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def check_divisible(shape: Sequence[int], spec: P, sizes: Mapping[str, int], name: str) -> None:
  """`ShardingError` if a dimension of `shape` does not split evenly over its mesh axes."""
  for d, (n, entry) in enumerate(zip(shape, spec)):
    ways = math.prod(sizes.get(a, 1) for a in _targets(entry))
    if n % ways:
      raise ShardingError(f"parameter {name!r}: dimension {d} (size {n}) does not split over mesh "
                          f"axes {_targets(entry)} ({ways} ways); change the mesh or the rule")


def fit_spec(spec: P, mesh) -> P:
  """`spec` keeping only mesh axes that `mesh` has (a Mesh, AbstractMesh or {axis: size})."""
  names = set(mesh.keys() if isinstance(mesh, Mapping) else mesh.axis_names)
  def keep(entry):
    kept = tuple(e for e in _targets(entry) if e in names)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
  return P(*(keep(e) for e in spec))


def _sizes(mesh) -> Mapping[str, int]:
  return mesh if isinstance(mesh, Mapping) else dict(mesh.shape)


def mesh_axes(mesh, logical: str, rules: Rules | None = None, *,
              min_size: int = 2) -> tuple[str, ...]:
  """The mesh axes (present, of size ≥ min_size) that logical axis `logical` is split over, in
  rule order."""
  sizes = _sizes(mesh)
  return tuple(a for a in _targets(_rules(rules)[logical]) if a in sizes and sizes[a] >= min_size)


def axes_size(mesh, axes: Iterable[str]) -> int:
  sizes = _sizes(mesh)
  return math.prod(sizes.get(a, 1) for a in axes)


def batch_axes(mesh, rules: Rules | None = None) -> tuple[str, ...]:
  """Mesh axes (size > 1) the batch is split over under the "batch" rule."""
  return mesh_axes(mesh, "batch", rules)


def batch_ways(mesh, rules: Rules | None = None) -> int:
  """How many batch shards the mesh has: the product of `batch_axes`."""
  return axes_size(mesh, batch_axes(mesh, rules))


def check_batch(global_batch: int, mesh, rules: Rules | None = None) -> int:
  """`global_batch` if it splits over the batch shards, else a `ShardingError` saying how."""
  axes, ways = batch_axes(mesh, rules), batch_ways(mesh, rules)
  if global_batch < 1 or global_batch % ways:
    raise ShardingError(f"global batch {global_batch} does not split over the mesh's batch axes "
                        f"{axes} ({ways} ways); use a positive multiple of {ways}")
  return global_batch


def batch_spec(mesh, ndim: int = 1, rules: Rules | None = None) -> P:
  """PartitionSpec of a batch-leading array: dim 0 over the batch axes, the rest replicated."""
  axes = batch_axes(mesh, rules)
  lead = None if not axes else (axes[0] if len(axes) == 1 else axes)
  return P(lead, *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int = 1, rules: Rules | None = None) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(mesh, ndim, rules))


def shard_spec(mesh, axes: Sequence[str | None], rules: Rules | None = None) -> P:
  """PartitionSpec of logical `axes` on `mesh`, keeping only its mesh axes of size > 1 (the form
  shard_map in_specs / out_specs take)."""
  sizes = _sizes(mesh)
  spec = logical_to_mesh(axes, rules=rules)
  def keep(entry):
    kept = tuple(a for a in _targets(entry) if sizes.get(a, 1) > 1)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
  return P(*(keep(e) for e in spec))


def context_mesh():
  """The abstract mesh in context (`jax.set_mesh`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over MESH_AXES; `shape` gives sizes by name (missing = 1, one -1 = the rest)."""
  devices = list(jax.devices() if devices is None else devices)
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; the mesh axes are {MESH_AXES}")
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1 (got {dict(shape)})")
  fixed = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % fixed:
      raise ValueError(f"mesh {dict(shape)} does not divide the {len(devices)} devices")
    sizes[sizes.index(-1)] = len(devices) // fixed
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} has {int(np.prod(sizes))} devices but "
                     f"{len(devices)} are available; change the mesh sizes so their product is "
                     f"{len(devices)}")
  arr = np.asarray(devices).reshape(sizes)
  # Auto axes: GSPMD propagates shardings from the parameters and the constraints we place.
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def constrain(x: jax.Array, axes: Sequence[str | None], rules: Rules | None = None, *,
              first: Sequence[str] = ()) -> jax.Array:
  """`with_sharding_constraint` by logical names when a mesh is in context; identity otherwise.
  `first`: logical axes that take their mesh axes before the others (`logical_to_mesh`)."""
  mesh = context_mesh()
  if mesh is None:
    return x
  spec = logical_to_mesh(axes, x.ndim, rules, first=first)
  return jax.lax.with_sharding_constraint(x, fit_spec(spec, mesh))


# --- parameter creation -----------------------------------------------------------------------

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def fan_in_normal(fan_in_axes: Iterable[int] = (0,), scale: float = 1.0) -> Init:
  """N(0, scale² / fan_in) with fan_in the product of the given axes of the shape."""
  fan_in_axes = tuple(fan_in_axes)
  def init(key, shape, dtype):
    fan_in = int(np.prod([shape[a] for a in fan_in_axes]))
    return (scale / np.sqrt(fan_in)) * jax.random.normal(key, shape, dtype)
  return init


def normal(std: float) -> Init:
  return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def constant(value) -> Init:
  return lambda key, shape, dtype: jnp.broadcast_to(jnp.asarray(value, dtype), shape)


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], init: Init,
          dtype=jnp.float32) -> nnx.Param:
  """Create an `nnx.Param` carrying its logical axis names."""
  shape = tuple(int(s) for s in shape)
  axes = tuple(axes)
  if len(axes) != len(shape):
    raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)
