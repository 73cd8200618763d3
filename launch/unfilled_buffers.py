"""Scan stacks and conditional residual slots left unfilled on accelerators (`train.unfilled_buffers`).

jax fills two kinds of buffers with zeros that the program then overwrites or never reads:

- a `lax.scan`'s stacked outputs (`loops._empty_array`): the buffer each iteration writes its row
  into. In the train step these are the layer scans' saved inputs (s3: the bfloat16 streams
  [10, 4, 4096, 4, 1024] of the last run, 1.3 GB), the saved plans and selections, and in the
  backward the per-layer gradient stacks of every scanned weight;
- the residual slots a `lax.switch` branch does not produce (`ad_util.empty_like_aval`, from
  `conditionals._join_cond_outputs`): the CSA2 kind switch's Reuse layers fill the Full layer's
  compressor and indexer residuals, which the backward of a Reuse layer never reads.

Both come from jax's `lax.empty2`, which lowers to a zero constant broadcast to the buffer's shape:
on the GPU a write of every byte (session 54's H100 profile of s3: 5.7 ms of fills a micro-batch,
benchmarks/RESULTS.md). jax's own comment on `_empty_array` says it means to use `lax.empty`
there (an XLA `AllocateBuffer`, no write on GPUs and TPUs) once that is safe everywhere.
`install()` does that for this process: both functions return `lax.empty` of the shape, dtype and
sharding jax computed. On the CPU `lax.empty` lowers to zeros, so the CPU program computes the same
values; on an accelerator the filled values were never read, so results are the same bit for bit
unless XLA reads a slot jax did not write (which would be a bug, and the A/B's losses show it).

It patches two private jax functions (present in jax 0.10.2 and 0.11.2); where either is missing,
`install` logs why and changes nothing. `launch.setup.train_step_jit` installs it for a config with
`train.unfilled_buffers` and takes it out for one without (configs/small.py: on from s3 up, where
one H200 ran s3's step 3.1-4.7 % faster and the s1 loss A/B found no difference, RESULTS.md).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_saved: dict = {}


def _device_memory(aval) -> bool:
  """Whether the aval lives in device memory (`lax.empty` takes no memory space)."""
  space = getattr(aval, "memory_space", None)
  return space is None or str(space).rsplit(".", 1)[-1] in ("Device", "Any")


def install(stacks: bool = True, switch_slots: bool = True) -> bool:
  """Make scan stacks and conditional residual slots `lax.empty` for this process (`stacks` /
  `switch_slots` False leaves that kind filled: benchmarks/zero_fills.py counts each). Returns
  whether it is installed (a second call changes nothing until `uninstall`); False, with one log
  line, where this jax lacks the functions."""
  if _saved:
    return True
  import jax
  try:
    from jax import lax
    from jax._src import ad_util, core
    from jax._src.lax.control_flow import loops
    orig_stack = loops._empty_array
    orig_like = ad_util.aval_empty_likers[core.ShapedArray]
  except (ImportError, AttributeError, KeyError) as e:
    log.warning("train.unfilled_buffers: this jax has no %s; buffers stay zero-filled", e)
    return False

  def unfilled(ref, aval):
    # `ref` is jax's own zero fill, traced and left unused (dead code): its shape and sharding
    # are what jax computed for the buffer.
    if not _device_memory(aval):
      return ref
    empty = lax.empty(ref.shape, ref.dtype, out_sharding=core.typeof(ref).sharding)
    return core.pvary(empty, tuple(aval.mat.varying))

  def stack(prefix, length_spec, aval):
    return unfilled(orig_stack(prefix, length_spec, aval), aval)

  def like(aval):
    return unfilled(orig_like(aval), aval)

  _saved.update(stack=(loops, orig_stack), like=(ad_util, orig_like))
  if stacks:
    loops._empty_array = stack
  if switch_slots:
    ad_util.aval_empty_likers[core.ShapedArray] = like
  jax.clear_caches()   # programs traced or lowered before keep their fills otherwise
  return True


def uninstall() -> None:
  """Undo `install` (a config without `train.unfilled_buffers`; tests): programs traced from then
  on fill as jax does."""
  if not _saved:
    return
  import jax
  from jax._src import core
  loops, orig_stack = _saved.pop("stack")
  ad_util, orig_like = _saved.pop("like")
  loops._empty_array = orig_stack
  ad_util.aval_empty_likers[core.ShapedArray] = orig_like
  jax.clear_caches()


def installed() -> bool:
  return bool(_saved)
