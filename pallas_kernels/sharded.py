"""Run a kernel per batch shard under the ambient mesh (docs/design.md §T1, §T5).

GSPMD does not partition a `pallas_call`: under a mesh it would gather its inputs onto every
device. The kernels are independent per batch row, so `over_batch(fn, batched)` runs `fn` inside
`jax.shard_map` with the leading (batch) axis of the `batched` arguments and of every output split
over the batch mesh axes, and the other arguments (parameters) replicated. Without a mesh in
context (`jax.set_mesh`) it is `fn` itself. The dispatcher (`pallas_kernels.dispatch`) wraps
each batched kernel once, custom VJP included: the backward runs per shard too, and shard_map's
transpose sums the replicated parameters' gradients over the shards.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.notices import log_once

# The mesh axes the model's logical "batch" axis maps to (dsv41_jax.sharding.RULES), restated
# because pallas_kernels does not import the model.
BATCH_AXES = ("data", "fsdp", "expert", "engram")

def batch_axes(mesh, lead: int) -> tuple[str, ...]:
  """The batch mesh axes (size > 1) whose product divides `lead`, dropping from the end."""
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  while axes and lead % math.prod(mesh.shape[a] for a in axes):
    axes = axes[:-1]
  return axes


def over_batch(fn: Callable, batched: Sequence[bool]) -> Callable:
  """`fn(*args, **static)` per batch shard of the ambient mesh (see module doc); `static` are
  keyword arguments that are not arrays."""
  @functools.wraps(fn)
  def wrapped(*args, **static):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      return fn(*args, **static)
    lead = next(a.shape[0] for a, b in zip(args, batched) if b)
    axes = batch_axes(mesh, lead)
    full = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if axes != full:
      log_once(("over_batch", lead, full),
               f"Pallas kernel {getattr(fn, '__name__', fn)}: batch {lead} is not split over mesh "
               f"axes {full}; splitting over {axes} only (the rest see the whole batch)")
    if not axes:
      return fn(*args, **static)
    spec = P(axes)
    return jax.shard_map(functools.partial(fn, **static),
                         in_specs=tuple(spec if b else P() for b in batched),
                         out_specs=spec, check_vma=False)(*args)
  return wrapped
