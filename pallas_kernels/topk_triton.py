"""The radix top-k's selection as one Triton program per row (docs/design.md §5.4).

`pallas_kernels.topk_select.radix_topk` finds each row's K-th largest score in 8 XLA passes over
the [rows, N] scores, each a 16-bin count, and places the selected entries by a binary search of
every row's running count: on the H200 that is 4.5 ms at 4 × 4,096 rows of 4,096 entries, slower
than `lax.top_k` (RESULTS.md, "The s3 step by source, kernels on and off"), although the scores
are read in 0.06 ms. Here one program holds a row in registers and does the whole selection
there, reading the row once and writing its K slots:

  key      the radix select's keys (the floats' total order: −0.0 below +0.0, as `lax.top_k`
           orders them) as int32, so that signed order is key order; invisible entries INT32_MIN.
           With `visible=None` the kernel reads the float scores and makes the keys itself
           (visible = score > −inf, the indexer's masked scores): no key array in memory
  need     min(K, visible entries)
  τ        the need-th largest key, a digit of `digit_bits` bits at a time from the top: the
           digit is the number of candidates u | m·2^lo (m = 1 … 2^bits − 1) that at least
           `need` keys reach, all 2^bits counts from one compare-and-sum of the row (32 / bits
           block reductions a row: 32 at 1 bit, the default, 8 at 4 bits; on the H100 the 1-bit
           form was the fastest, RESULTS.md session 58)
  selected key > τ, or key == τ and fewer than need − #(key > τ) equal keys before it (ties to
           the lowest indices: `lax.top_k`'s rule)
  slot     the number of selected entries before it, from one running sum of the row that
           carries the counts of keys above τ (low 16 bits) and of ties (high 16 bits): the
           slots hold the set in ascending index order, −1 past `need`: `radix_topk`'s results

Each entry is stored at its slot under a mask, every lane at a distinct address (the unselected
ones at their rank after the selected, masked off), so no two lanes write one address. Interpret
mode (the CPU) models a masked store as a read-modify-write of every lane's address, so there the
output row is N wide (every lane's address exists); compiled, it is K wide and masked lanes never
touch memory.

Rows wider than `MAX_ENTRIES` are refused (`unsupported_reason`): a row lives in the registers of
one program, 16 warps at most (and the running sum's halves hold counts up to 2^16 − 1).
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

MAX_ENTRIES = 16384
_MIN = np.int32(np.iinfo(np.int32).min)


def _pow2(n: int) -> int:
  return max(16, 1 << (n - 1).bit_length())


def ordered_int_keys(x: jax.Array) -> jax.Array:
  """int32 keys of float32 values whose signed order is the floats' total order (−0.0 < +0.0):
  the radix select's uint32 keys with the top bit flipped (its key 0 is INT32_MIN here). In int32
  alone, so the kernel makes them too: the float bits b are already in order for b ≥ 0 (+0.0 …
  +NaN), and the negative floats' order is reversed by flipping the 31 low bits."""
  b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(b >= 0, b, b ^ jnp.int32(0x7FFFFFFF))


def unsupported_reason(scores_BxTxN, visible_BxTxN, k: int) -> str | None:
  """Why the kernel cannot take these arguments (None if it can)."""
  n = scores_BxTxN.shape[-1]
  if n > MAX_ENTRIES:
    return f"{n} entries per row exceed the {MAX_ENTRIES} one program holds in registers"
  return None


def _digit(keys, need, m, u, lo):
  """The digit of τ at bit `lo` after the prefix u, and the counts [2^bits] of keys reaching each
  candidate u | m·2^lo (the digit is the number of candidates that `need` keys reach, less one)."""
  cand = u | (m << lo)                                   # wraps into the sign bit for lo + bits = 32
  reach = jnp.sum((keys[None, :] >= (cand ^ _MIN)).astype(jnp.int32), axis=1)
  return jnp.sum((reach >= need).astype(jnp.int32)) - 1, reach


def _tau_early_exit(keys, need, m, digit_bits):
  """τ by the same digits, stopping once exactly `need` keys reach the prefix: a device loop
  carrying the prefix u and r = #(keys ≥ u), the count of the digit it chose. Then the keys ≥ u
  are the selected set, and τ, the need-th largest, is their least (one min reduction). Float
  scores of a row rarely tie, so the prefix isolates the need-th key after its exponent and a
  few mantissa bits (about log2 of the keys sharing its binade) instead of all 32; tied rows run
  to the last digit, where u is τ (the min then returns u itself)."""
  steps = 32 // digit_bits

  def cond(c):
    i, _, r = c
    return (i < steps) & (r != need)

  def body(c):
    i, u, _ = c
    lo = 32 - digit_bits * (i + 1)
    digit, reach = _digit(keys, need, m, u, lo)
    r = jnp.sum(jnp.where(m[:, 0] == digit, reach, 0))
    return i + 1, u | (digit << lo), r

  # r starts as #(keys ≥ INT32_MIN): every lane, the padding's too.
  _, u, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), jnp.int32(keys.shape[0])))
  floor = u ^ _MIN
  return jnp.min(jnp.where(keys >= floor, keys, jnp.int32(np.iinfo(np.int32).max)))


def _select_kernel(row_ref, need_ref, o_ref, *, k_slots, k, digit_bits, from_scores,
                   early_exit=False):
  if from_scores:                                        # [Np] float32, invisible = −inf
    s = row_ref[...]
    visible = s > -jnp.inf
    keys = jnp.where(visible, ordered_int_keys(s), _MIN)
    need = jnp.minimum(jnp.sum(visible.astype(jnp.int32)), k)
  else:                                                  # [Np] int32, invisible = INT32_MIN
    keys = row_ref[...]
    need = need_ref[0]
  # τ's bits so far with the sign bit flipped (an unsigned prefix): the candidates of a digit
  # are prefix | m << lo for m = 0 … 2^bits − 1, counted at once ([2^bits, Np] compares, one
  # reduction); m = 0 always reaches `need`, and the counts fall with m, so the digit is the
  # number of candidates that reach it, less one.
  m = jax.lax.broadcasted_iota(jnp.int32, (1 << digit_bits, 1), 0)
  if early_exit:
    tau = _tau_early_exit(keys, need, m, digit_bits)
  else:
    u = jnp.int32(0)
    for lo in range(32 - digit_bits, -1, -digit_bits):
      u = u | (_digit(keys, need, m, u, lo)[0] << lo)
    tau = u ^ _MIN
  above = (keys > tau).astype(jnp.int32)
  tie = (keys == tau).astype(jnp.int32)
  packed = above + (tie << 16)                           # one running sum carries both counts
  before = jnp.cumsum(packed) - packed
  above_before, ties_before = before & 0xFFFF, before >> 16
  n_above = jnp.sum(above)
  quota = need - n_above                                 # ties taken, lowest indices first
  selected = (above > 0) | ((tie > 0) & (ties_before < quota))
  sel_before = above_before + jnp.minimum(ties_before, quota)
  count = n_above + jnp.minimum(jnp.sum(tie), quota)
  cols = jax.lax.broadcasted_iota(jnp.int32, keys.shape, 0)
  slots = jax.lax.broadcasted_iota(jnp.int32, (k_slots,), 0)
  plgpu.store(o_ref.at[slots], jnp.full((k_slots,), -1, jnp.int32), mask=slots >= count)
  # Distinct addresses for every lane (module doc): the unselected after the selected.
  plgpu.store(o_ref.at[jnp.where(selected, sel_before, count + cols - sel_before)], cols,
              mask=selected)


def triton_topk(scores_BxTxN: jax.Array, visible_BxTxN: jax.Array | None, k: int, *,
                interpret: bool | None = None, num_warps: int | None = None,
                digit_bits: int = 1, early_exit: bool = False) -> jax.Array:
  """topk_BxTxK int32 (K = min(k, N)): `radix_topk`'s results (the set `lax.top_k` selects among
  the visible entries, ascending, −1 past the number visible), one Triton program per row.
  `visible_BxTxN=None`: the entries whose score is above −inf (the kernel reads the scores and
  makes the keys itself); `digit_bits` (1, 2 or 4) of τ found per reduction; `early_exit` stops
  the digits once the prefix isolates the need-th key (`_tau_early_exit`; the same slots; 0.82
  ms against 0.94 at 4 × 4,096 × top-256 with the keys in the kernel on an H100, session 59: the
  indexer's default)."""
  if (reason := unsupported_reason(scores_BxTxN, visible_BxTxN, k)):
    raise ValueError(f"Triton top-k: {reason}")
  if digit_bits not in (1, 2, 4):
    raise ValueError(f"Triton top-k: digit_bits must be 1, 2 or 4 (got {digit_bits})")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  *lead, n = scores_BxTxN.shape
  k_eff = min(k, n)
  n_pad, k_pad = _pow2(n), _pow2(k_eff)
  rows = int(np.prod(lead, dtype=np.int64))
  scores = jax.lax.stop_gradient(scores_BxTxN)
  from_scores = visible_BxTxN is None
  if from_scores:
    row = jnp.pad(scores.astype(jnp.float32).reshape(rows, n), ((0, 0), (0, n_pad - n)),
                  constant_values=-jnp.inf)
    need = jnp.zeros((rows, 1), jnp.int32)           # unread: the kernel counts the row itself
  else:
    keys = jnp.where(visible_BxTxN, ordered_int_keys(scores), _MIN)
    row = jnp.pad(keys.reshape(rows, n), ((0, 0), (0, n_pad - n)), constant_values=_MIN)
    need = jnp.minimum(jnp.sum(visible_BxTxN, axis=-1, dtype=jnp.int32), k_eff).reshape(-1, 1)
  width = n_pad if interpret else k_pad
  warps = num_warps or int(np.clip(n_pad // 512, 4, 16))
  # Called through `jax.jit`: remat's partial evaluation stages a bare `pallas_call` into the
  # recomputed forward even when every input is known, so the named selection below could not be
  # saved and layer remat would select (and score) again in the backward; a jitted call's rule
  # keeps it in the forward (tests/pallas_kernels/test_topk_triton.py).
  out = jax.jit(pl.pallas_call(
      functools.partial(_select_kernel, k_slots=k_pad, k=k_eff, digit_bits=digit_bits,
                        from_scores=from_scores, early_exit=early_exit),
      out_shape=jax.ShapeDtypeStruct((rows, width), jnp.int32),
      grid=(rows,),
      in_specs=[pl.BlockSpec((None, n_pad), lambda r: (r, 0)),
                pl.BlockSpec((None, 1), lambda r: (r, 0))],
      out_specs=pl.BlockSpec((None, width), lambda r: (r, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      interpret=interpret, name="triton_topk"))(row, need)
  return checkpoint_name(out[:, :k_eff].reshape(*lead, k_eff), _ops.SELECTION)
