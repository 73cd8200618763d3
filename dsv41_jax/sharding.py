"""Logical axis names and the one table that maps them onto the mesh (TRAINING.md §1).

Every parameter is created through `param(...)` with a tuple of logical axis names, stored as the
`logical_axes` metadata of its `nnx.Param`. `logical_to_mesh` turns those names into a
`PartitionSpec` with `RULES`; swapping the rules changes the parallelism, never the model code.
Parameters stacked by the layer scan carry extra leading axes that are never split.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "engram", "tensor")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
RULES: Mapping[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp", "expert", "engram"),
    "seq": None,
    # dense weights: ZeRO-3 over fsdp on the model width, heads / MLP width over tensor
    "embed": "fsdp",
    "vocab": "tensor",
    "q_lora": None,
    "heads": "tensor",
    "head_dim": None,
    "kv": None,
    "o_groups": "tensor",
    "o_lora": None,
    "o_in": None,
    "o_cat": "tensor",  # wo_b input, the G·O concatenated group outputs: row-parallel
    "mlp": "tensor",
    "index_heads": None,
    "index_dim": None,
    # MoE
    "expert": "expert",
    "expert_router": None,
    # mHC coefficients and other small axes
    "hc": None,
    "hc_mix": None,
    "norm": None,
    # Engram
    "engram_rows": "engram",
    "engram_dim": None,
    "engram_in": None,
    "engram_out": "tensor",
    # vision
    "vit_embed": None,
    "vit_mlp": "tensor",
    "vit_heads": "tensor",  # ViT q/k/v output and wo input: heads flattened with head_dim
    "patch": None,
    "proj_in": None,  # projector input: u² concatenated ViT features
    "proj_mlp": "tensor",
}


def logical_to_mesh(axes: Sequence[str | None], ndim: int | None = None,
                    rules: Mapping[str, str | tuple[str, ...] | None] = RULES) -> P:
  """PartitionSpec for logical `axes`; extra leading dims (scan-stacked layers) are replicated.

  A mesh axis is used at most once per spec: a later logical axis that maps to a mesh axis already
  taken stays unsplit.
  """
  axes = tuple(axes)
  if ndim is not None and ndim < len(axes):
    raise ValueError(f"array of rank {ndim} cannot carry logical axes {axes}")
  used: set[str] = set()
  out: list = []
  for name in axes:
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise KeyError(f"logical axis {name!r} has no entry in the sharding rules")
    target = rules[name]
    if target is None:
      out.append(None)
      continue
    targets = (target,) if isinstance(target, str) else tuple(target)
    free = tuple(t for t in targets if t not in used)
    used.update(free)
    out.append(free[0] if len(free) == 1 else (free or None))
  lead = [] if ndim is None else [None] * (ndim - len(axes))
  return P(*lead, *out)


def param_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
  meta = variable.get_metadata()
  if "logical_axes" not in meta:
    raise ValueError(f"parameter of shape {variable.shape} was created without logical_axes")
  return tuple(meta["logical_axes"])


def state_partition_specs(state, rules=RULES):
  """Map an `nnx.State` of Params to a pytree (same structure) of PartitionSpecs."""
  def spec(v):
    if isinstance(v, nnx.Variable):
      return v.replace(logical_to_mesh(param_axes(v), v.ndim if hasattr(v, "ndim") else
                                       len(v.shape), rules))
    return P()
  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state, mesh: Mesh, rules=RULES):
  """NamedShardings for every leaf of an `nnx.State`, dropping mesh axes the mesh lacks."""
  specs = state_partition_specs(state, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, _fit(s, mesh)), specs,
                      is_leaf=lambda x: isinstance(x, P))


def _fit(spec: P, mesh: Mesh) -> P:
  names = set(mesh.axis_names)
  def keep(entry):
    if entry is None:
      return None
    if isinstance(entry, str):
      return entry if entry in names else None
    kept = tuple(e for e in entry if e in names)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
  return P(*(keep(e) for e in spec))


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


def constrain(x: jax.Array, axes: Sequence[str | None], rules=RULES) -> jax.Array:
  """`with_sharding_constraint` by logical names when a mesh is in context; identity otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return x
  spec = logical_to_mesh(axes, x.ndim, rules)
  return jax.lax.with_sharding_constraint(x, _fit(spec, mesh))


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
