"""The radix top-k's selection as one Triton program per row (docs/design.md §5.4).

`pallas_kernels.topk_select.radix_topk` finds each row's K-th largest score in 8 XLA passes over
the [rows, N] scores, each a 16-bin count, and places the selected entries by a binary search of
every row's running count: on the H200 that is 4.5 ms at 4 × 4,096 rows of 4,096 entries, slower
than `lax.top_k` (RESULTS.md, "The s3 step by source, kernels on and off"), although the scores
are read in 0.06 ms. Here one program holds a row in registers and does the whole selection
there, reading the row once and writing its K slots:

  key      the radix select's keys (the floats' total order: −0.0 below +0.0, as `lax.top_k`
           orders them) as int32, so that signed order is key order; invisible entries INT32_MIN
  need     min(K, visible entries)
  τ        the need-th largest key, by 32 steps of a binary search on the key's bits, top first:
           a bit stays set when at least `need` keys are ≥ the candidate (one compare-and-sum of
           the row per bit, in registers)
  selected key > τ, or key == τ and fewer than need − #(key > τ) equal keys before it (ties to
           the lowest indices: `lax.top_k`'s rule)
  slot     the entry's rank among the selected (a running sum of the row), so the slots hold the
           set in ascending index order, −1 past `need`: `radix_topk`'s results exactly

Each entry is stored at its slot under a mask, every lane at a distinct address (the unselected
ones at their rank after the selected, masked off), so no two lanes write one address. Interpret
mode (the CPU) models a masked store as a read-modify-write of every lane's address, so there the
output row is N wide (every lane's address exists); compiled, it is K wide and masked lanes never
touch memory.

Rows wider than `MAX_ENTRIES` are refused (`unsupported_reason`): a row lives in the registers of
one program, 16 warps at most.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ops import indexer as _ops
from pallas_kernels.topk_select import ordered_keys

MAX_ENTRIES = 16384
_MIN = np.int32(np.iinfo(np.int32).min)


def _pow2(n: int) -> int:
  return max(16, 1 << (n - 1).bit_length())


def ordered_int_keys(x: jax.Array) -> jax.Array:
  """int32 keys of float32 values whose signed order is the floats' total order (−0.0 < +0.0):
  the radix select's uint32 keys with the top bit flipped (its key 0 is INT32_MIN here)."""
  return jax.lax.bitcast_convert_type(ordered_keys(x) ^ jnp.uint32(0x80000000), jnp.int32)


def unsupported_reason(scores_BxTxN, visible_BxTxN, k: int) -> str | None:
  """Why the kernel cannot take these arguments (None if it can)."""
  n = scores_BxTxN.shape[-1]
  if n > MAX_ENTRIES:
    return f"{n} entries per row exceed the {MAX_ENTRIES} one program holds in registers"
  return None


def _select_kernel(keys_ref, need_ref, o_ref, *, k_slots):
  keys = keys_ref[...]                                   # [Np] int32, invisible = INT32_MIN
  need = need_ref[0]
  u = jnp.int32(0)                                       # τ's bits found so far, sign bit flipped
  for bit in range(31, -1, -1):
    cand = u | jnp.int32(np.uint32(1 << bit).view(np.int32))
    n_at_or_above = jnp.sum((keys >= (cand ^ _MIN)).astype(jnp.int32))
    u = jnp.where(n_at_or_above >= need, cand, u)
  tau = u ^ _MIN
  above = keys > tau
  tie = (keys == tau).astype(jnp.int32)
  ties_before = jnp.cumsum(tie) - tie
  selected = above | ((tie > 0) & (ties_before < need - jnp.sum(above.astype(jnp.int32))))
  sel = selected.astype(jnp.int32)
  slot = jnp.cumsum(sel) - 1
  count = jnp.sum(sel)
  cols = jax.lax.broadcasted_iota(jnp.int32, keys.shape, 0)
  slots = jax.lax.broadcasted_iota(jnp.int32, (k_slots,), 0)
  plgpu.store(o_ref.at[slots], jnp.full((k_slots,), -1, jnp.int32), mask=slots >= count)
  # Distinct addresses for every lane (module doc): the unselected after the selected.
  plgpu.store(o_ref.at[jnp.where(selected, slot, count + cols - slot - 1)], cols, mask=selected)


def triton_topk(scores_BxTxN: jax.Array, visible_BxTxN: jax.Array, k: int, *,
                interpret: bool | None = None, num_warps: int | None = None) -> jax.Array:
  """topk_BxTxK int32 (K = min(k, N)): `radix_topk`'s results (the set `lax.top_k` selects among
  the visible entries, ascending, −1 past the number visible), one Triton program per row."""
  if (reason := unsupported_reason(scores_BxTxN, visible_BxTxN, k)):
    raise ValueError(f"Triton top-k: {reason}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  *lead, n = scores_BxTxN.shape
  k_eff = min(k, n)
  n_pad, k_pad = _pow2(n), _pow2(k_eff)
  keys = jnp.where(visible_BxTxN, ordered_int_keys(jax.lax.stop_gradient(scores_BxTxN)), _MIN)
  keys = jnp.pad(keys.reshape(-1, n), ((0, 0), (0, n_pad - n)), constant_values=_MIN)
  need = jnp.minimum(jnp.sum(visible_BxTxN, axis=-1, dtype=jnp.int32), k_eff).reshape(-1, 1)
  width = n_pad if interpret else k_pad
  rows = keys.shape[0]
  warps = num_warps or int(np.clip(n_pad // 512, 4, 16))
  # Called through `jax.jit`: remat's partial evaluation stages a bare `pallas_call` into the
  # recomputed forward even when every input is known, so the named selection below could not be
  # saved and layer remat would select (and score) again in the backward; a jitted call's rule
  # keeps it in the forward (tests/pallas_kernels/test_topk_triton.py).
  out = jax.jit(pl.pallas_call(
      functools.partial(_select_kernel, k_slots=k_pad),
      out_shape=jax.ShapeDtypeStruct((rows, width), jnp.int32),
      grid=(rows,),
      in_specs=[pl.BlockSpec((None, n_pad), lambda r: (r, 0)),
                pl.BlockSpec((None, 1), lambda r: (r, 0))],
      out_specs=pl.BlockSpec((None, width), lambda r: (r, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      interpret=interpret, name="triton_topk"))(keys, need)
  return checkpoint_name(out[:, :k_eff].reshape(*lead, k_eff), _ops.SELECTION)
