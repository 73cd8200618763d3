"""Routed-expert dispatch: sort tokens by expert, grouped matmuls, expert-parallel all-to-all.

Implements the expert computation of docs/design.md §8.1–8.2 (y_t = Σ_{i∈sel_t} g_t,i · E_i(x_t)) for the
routed experts only, computing just the routed (token, expert) pairs, and its distribution over the
mesh (docs/design.md §T1 "MoE across devices", §T7 for why there are two modes). The routing weight
scales the activation before the down-projection, `W2 (g · SiLU(a) ⊙ u)` in float32 and then cast
to the compute dtype, as the official V4 `Expert` does: equal to g · W2(...) in exact arithmetic,
and in bf16 the rounding of the released model. The pairs of a token are then summed in float32.

Product outputs (`product_dtype`, `ModelConfig.moe_product_dtype`): "float32" keeps each expert
product's float32 accumulator as its output ([a | u] and the down-projection, before the pairs'
float32 sum); "compute" rounds each once to the compute dtype, as the official V4 code's bf16
`Linear`s do (`gate = w1(x).float()`, the expert's output from `w2` in bf16, the pairs summed in
float32): half the bytes of the two largest MoE intermediates, and their cotangents reach the
backward products already in the operands' dtype. With the MLP width split over `tensor` the
down-projection's partial sums stay float32 until the psum and are rounded after it.

Pairs are ordered slot-major, `p = k·N + n` (every token's first choice before any second choice),
and stably sorted by expert; that order is also the capacity priority.

Modes (`cfg.moe_dispatch`):
- `dropless`: exact. Sorted pairs go through one grouped GEMM per weight, the op `grouped_matmul`
  of the dispatcher under `policy` (`cfg.ops.grouped_matmul`): `jax.lax.ragged_dot` (the op's
  reference) or the Mosaic GPU grouped GEMM with its own backward (`pallas_kernels.grouped_matmul`,
  docs/design.md §T7), which "auto" takes on a Hopper GPU.
- `capacity`: each expert takes at most `C = min(n, ceil(capacity_factor · n·K / E))` pairs of the
  n tokens of one batch shard (one device; the whole batch without a mesh), in the slot-major
  order above; the rest are dropped and contribute nothing for that expert (the other selected
  experts of the token keep their unrenormalised weights). Expert math is a batched matmul
  `"ecd,edf->ecf"` over an [E, C, D] buffer. With `capacity_factor ≥ E/K`, C = n and nothing drops.

Expert parallelism: when the logical axis "expert" maps to mesh axes of G > 1 devices in all
(`sharding.RULES`: `expert` × `engram`, the axes of size > 1 of the mesh) the dispatch
runs inside `jax.shard_map` (batch split over the batch axes, expert weights over those axes, the
MLP width over `tensor` with a psum; specs from `dsv41_jax.sharding`) and exchanges tokens with the
experts' owners by `all_to_all` over those axes:
- `dropless`: each device sends every destination a static buffer of S = n·min(K, E/G) rows (the
  worst case: a token picks an expert at most once, so at most min(K, E/G) of its pairs go to one
  owner). Exact, nothing dropped; the cost is G·S ≥ n·K rows of exchange buffer.
- `capacity`: the [E, C, D] buffer of the local tokens is cut into the G owners' [E/G, C, D]
  slices (C from the local n), so each device exchanges exactly the capacity buffer; drops follow
  the local rule above, counted exactly.
Without a mesh the same code runs locally; with a mesh but G = 1 it runs per device in shard_map
(no exchange), so sorting never crosses devices.

Bad input is never a silently wrong product: an expert id outside [0, E) on a valid token makes
that token's output NaN (a concrete one raises ValueError); group sizes that are negative or sum
past the row count make the whole grouped product NaN (concrete: ValueError).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from dsv41_jax import sharding
from pallas_kernels import dispatch

MODES = ("dropless", "capacity")
PRODUCT_DTYPES = ("float32", "compute")

# Remat name of the MoE layer's kept values (`dsv41_jax.model.remat_policy` saves them): here the
# pair sort's permutation, its inverse and the group sizes (3 · N·K + E int32 a layer), so layer
# remat does not sort again; in `moe.MoE` the router logits and the layer's output.
KEPT = "moe_kept"
# Remat name of the routed experts' gate|up product (kept only where `ModelConfig.remat_saves`
# has "experts": `dsv41_jax.model.layer_remat_policy`).
GATE_UP = "moe_gate_up"


def clamped_swiglu(a, u, limit: float):
  """SiLU(min(a, limit)) · clip(u, −limit, limit) in float32 (docs/design.md §8.2)."""
  a = jnp.minimum(a.astype(jnp.float32), limit)
  u = jnp.clip(u.astype(jnp.float32), -limit, limit)
  return jax.nn.silu(a) * u


def _weighted_swiglu(au_PxF2, weight_P, limit: float, dtype):
  """`weighted_swiglu` without its VJP (autodiff's; the tests' reference)."""
  f = au_PxF2.shape[-1] // 2
  h = clamped_swiglu(au_PxF2[:, :f], au_PxF2[:, f:], limit) * weight_P[:, None]
  return h.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def weighted_swiglu(au_PxF2, weight_P, limit: float, dtype):
  """h = g · clamped_swiglu(a, u), rounded to `dtype`, with [a | u] = au [P, 2F] (the fused
  gate|up product, float32) and g = weight [P] (float32); [P, F].

  Autodiff's arithmetic, from the residuals au and g only: the derivative is `jax.vjp` of
  `clamped_swiglu`, and the cotangent of [a | u] is assembled as the transpose of the two slices
  is (a masked -0 reads +0, as before). The backward is written over one index space,
  [P, 2, F] = [P, 2F]: the cotangent of [a | u], and g's Σ_f dh·s summed over the same [P, 2, F]
  with zeros in the u half, so XLA can emit both as one multi-output fusion that reads au and dh
  once (autodiff's g-gradient is a sum over [P, F], which cannot share a loop with a [P, 2F]
  output: a second pass over au and dh). On the CPU the values are autodiff's bit for bit under
  layer remat (`test_moe_dispatch`); a backend that orders the [P, 2F] sum otherwise than the
  [P, F] one rounds g's gradient differently, within float32 rounding."""
  return _weighted_swiglu(au_PxF2, weight_P, limit, dtype)


def _weighted_swiglu_fwd(au_PxF2, weight_P, limit, dtype):
  return _weighted_swiglu(au_PxF2, weight_P, limit, dtype), (au_PxF2, weight_P)


def _weighted_swiglu_bwd(limit, dtype, res, dh_PxF):
  au_PxF2, weight_P = res
  p, f2 = au_PxF2.shape
  f = f2 // 2
  au_Px2xF = au_PxF2.reshape(p, 2, f)
  s_PxF, pullback = jax.vjp(lambda a, u: clamped_swiglu(a, u, limit), au_Px2xF[:, 0],
                            au_Px2xF[:, 1])
  dh_PxF = dh_PxF.astype(jnp.float32)
  da_PxF, du_PxF = pullback(dh_PxF * weight_P[:, None])
  # in au's dtype: a bf16 [a | u] (`product_dtype="compute"`) takes its cotangent rounded once
  # here, as the grouped product's backward would round it
  d_au = (jnp.pad(da_PxF, ((0, 0), (0, f))) + jnp.pad(du_PxF, ((0, 0), (f, 0)))
          ).astype(au_PxF2.dtype)
  # g's cotangent Σ_f dh·s as the VJP of g -> g·s with s placed in [P, 2, F] (zeros in the u
  # half): a reduction over d_au's index space, and, inside shard_map, the psum over the mesh axes
  # that au varies over and g does not (the MLP width split over `tensor`), as autodiff has it.
  s_Px2xF = jnp.where((jnp.arange(2) == 0)[None, :, None], s_PxF[:, None, :], 0.0)
  _, weight_transpose = jax.vjp(lambda g: g[:, None, None] * s_Px2xF, weight_P)
  (d_weight,) = weight_transpose(jnp.broadcast_to(dh_PxF[:, None, :], s_Px2xF.shape))
  return d_au, d_weight


weighted_swiglu.defvjp(_weighted_swiglu_fwd, _weighted_swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def expert_einsum(equation: str, x, w):
  """`einsum(equation, x, w)` of compute-dtype operands (w already cast to x's dtype), float32
  accumulation and result; its backward rounds the float32 cotangent to x's dtype once and runs
  both transposed products on operands of that dtype, as the grouped matmul kernel does and as
  `jax.grad` of a product with x's dtype out would (docs/design.md §8.2). Without it a bf16
  model's expert backward multiplied float32 cotangents with bf16 weights: float32 GEMMs off the
  tensor cores' bf16 rate. With float32 operands it is autodiff of the einsum, bit for bit."""
  return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def _expert_einsum_fwd(equation, x, w):
  return expert_einsum(equation, x, w), (x, w)


def _expert_einsum_bwd(equation, res, g):
  # jax.vjp, not jax.linear_transpose: called outside jit, the latter closes over the residuals
  # as constants, and jax 0.11's CPU backend then lowered a transposed bf16 product that
  # accumulates in bf16 (490 bf16 ulps off float64 in test_moe_dispatch; 0.5 with arguments).
  x, w = res
  _, pullback = jax.vjp(lambda a, b: jnp.einsum(equation, a, b), x, w)
  return pullback(g.astype(x.dtype))


expert_einsum.defvjp(_expert_einsum_fwd, _expert_einsum_bwd)


def expert_capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
  """Static per-expert capacity C = min(n_tokens, ceil(capacity_factor · n_tokens · k / E))."""
  c = math.ceil(round(capacity_factor * n_tokens * k / n_experts, 6))
  return int(max(1, min(n_tokens, c)))


def _concrete(x):
  """x as a numpy array, or None while it is traced."""
  try:
    return np.asarray(x)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def grouped_matmul(x_sorted_PxD, w_ExDxF, group_sizes_E, policy: str = "auto",
                   out_dtype=jnp.float32):
  """Rows [Σ_{e'<e} g_e', Σ_{e'≤e} g_e') of x times w[e]; rows past Σ g are zero. Float32
  accumulation, `out_dtype` out (float32, or x's dtype: rounded once).

  The op `grouped_matmul` (`pallas_kernels.ops.grouped_matmul`, docs/design.md §T7) under
  `policy`. Group sizes that are negative or sum past P raise ValueError when concrete and make
  the product NaN when traced.
  """
  return dispatch.call("grouped_matmul", x_sorted_PxD, w_ExDxF, group_sizes_E, policy=policy,
                       out_dtype=out_dtype)


def gate_up_pair(w1_xExDxF: jax.Array, w3_xExDxF: jax.Array) -> tuple[jax.Array, jax.Array]:
  """w1 and w3 [..., E, D, F] as one array [..., E, D, 2, F] in w1's place and a zero-width
  [..., E, D, 0] in w3's: the routed experts as `launch.step.cast_once` hands them to the model
  once per step, so that the gate/up product's [w1 | w3] [E, D, 2F] is a free reshape rather than
  a concatenation in every layer's forward and remat pass. Each expert's columns stay together
  under an MLP width split over `tensor` (the split axis is F, after the pair axis). Every
  function here that takes (w1, w3) takes either form."""
  pair = jnp.stack([w1_xExDxF, w3_xExDxF], axis=-2)
  return pair, jnp.zeros(w3_xExDxF.shape[:-1] + (0,), w3_xExDxF.dtype)


def _is_pair(w1, w3) -> bool:
  return w3.shape[-1] == 0 and w1.ndim == w3.ndim + 1


def _gate_up_weight(w1, w3, dt) -> jax.Array:
  """[w1 | w3] [E, D, 2F] in `dt`, from the two weights or from `gate_up_pair`'s form."""
  if _is_pair(w1, w3):
    return w1.astype(dt).reshape(*w1.shape[:-2], 2 * w1.shape[-1])
  return jnp.concatenate([w1.astype(dt), w3.astype(dt)], axis=-1)


def gate_and_up(w1, w3) -> tuple[jax.Array, jax.Array]:
  """(w1, w3) [..., E, D, F] from either form (also splits a pair's gradient)."""
  return (w1[..., 0, :], w1[..., 1, :]) if _is_pair(w1, w3) else (w1, w3)


def grouped_ffn(x_sorted_PxD, weight_P, w1, w3, w2, group_sizes_E, limit: float,
                policy: str = "auto", gate_up_dtype=jnp.float32, out_dtype=jnp.float32):
  """Clamped SwiGLU experts over expert-sorted rows (grouped GEMMs), each row's activation times
  its routing weight before W2 (`weighted_swiglu`); [P, D] in `out_dtype`.

  The gate and up projections are one grouped product with [w1 | w3] [E, D, 2F]: x is read once
  and each output column is the same dot as in its own product (equal to two products). Each
  product accumulates in float32; [a | u] is returned in `gate_up_dtype` and the down-projection
  in `out_dtype` (float32, or the compute dtype: rounded once, module docstring). (w1, w3) may be
  `gate_up_pair`'s form."""
  dt = x_sorted_PxD.dtype
  w13 = _gate_up_weight(w1, w3, dt)
  au = checkpoint_name(grouped_matmul(x_sorted_PxD, w13, group_sizes_E, policy, gate_up_dtype),
                       GATE_UP)
  h = weighted_swiglu(au, weight_P, limit, dt)
  return grouped_matmul(h, w2, group_sizes_E, policy, out_dtype)


def batched_ffn(x_ExCxD, weight_ExC, w1, w3, w2, limit: float, gate_up_dtype=jnp.float32,
                out_dtype=jnp.float32):
  """Clamped SwiGLU experts over a capacity buffer (batched matmuls), each slot's activation times
  its routing weight before W2; [E, C, D] in `out_dtype` (a and u rounded to `gate_up_dtype`,
  as `grouped_ffn` rounds them); (w1, w3) may be `gate_up_pair`'s form."""
  dt = x_ExCxD.dtype
  w1, w3 = gate_and_up(w1, w3)
  a = checkpoint_name(expert_einsum("ecd,edf->ecf", x_ExCxD, w1.astype(dt)).astype(gate_up_dtype),
                      GATE_UP)
  u = checkpoint_name(expert_einsum("ecd,edf->ecf", x_ExCxD, w3.astype(dt)).astype(gate_up_dtype),
                      GATE_UP)
  h = (clamped_swiglu(a, u, limit) * weight_ExC[..., None]).astype(dt)
  return expert_einsum("ecf,efd->ecd", h, w2.astype(dt)).astype(out_dtype)


# --- pair bookkeeping ---------------------------------------------------------------------------

def _sort_pairs(experts_NxK, valid_N, n_experts: int):
  """Slot-major pairs sorted by expert; invalid (padding) pairs get expert E and sort last.

  Returns order_P (sorted position -> pair), inv_P (pair -> sorted position), e_sorted_P,
  token_sorted_P, group_sizes_E (valid pairs per expert).
  """
  n, k = experts_NxK.shape
  e_P = jnp.where(valid_N[None, :], experts_NxK.T, n_experts).reshape(-1).astype(jnp.int32)
  order = jnp.argsort(e_P, stable=True)
  inv = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
  # Per-expert counts as a compare-and-sum over [E, P], not a scatter-add: N·k pairs added into E
  # bins collide on every bin (the GPU serialises the atomics: ~18 µs a layer at s3).
  group_sizes = (e_P[None, :] == jnp.arange(n_experts, dtype=jnp.int32)[:, None]).sum(
      axis=1, dtype=jnp.int32)
  order, inv, group_sizes = checkpoint_name((order, inv, group_sizes), KEPT)
  return order, inv, e_P[order], order % n, group_sizes


def _combine(y_pairs_PxD, k: int):
  """y_n = Σ_k y_{(k, n)} (already weighted) with pairs in slot-major order; float32 [N, D]."""
  return y_pairs_PxD.reshape(k, -1, y_pairs_PxD.shape[-1]).astype(jnp.float32).sum(axis=0)


def _pair_weights(weights_NxK):
  """Routing weights of the pairs in slot-major order, float32 [N·K]."""
  return weights_NxK.T.reshape(-1).astype(jnp.float32)


def _pad_row(x_NxD):
  return jnp.concatenate([x_NxD, jnp.zeros((1, x_NxD.shape[1]), x_NxD.dtype)], axis=0)


@jax.custom_vjp
def _gather_pairs(x_NxD, tok_sorted_P, inv_KxN):
  """x[tok_sorted]: each sorted pair's token row. Its transpose is a gather too (no scatter):
  token n's cotangent is Σ_k g[inv[k, n]], its k pairs' sorted positions."""
  return x_NxD[tok_sorted_P]


def _gather_pairs_fwd(x_NxD, tok_sorted_P, inv_KxN):
  return x_NxD[tok_sorted_P], (tok_sorted_P, inv_KxN, jnp.zeros((0,), x_NxD.dtype))


def _gather_pairs_bwd(res, g_PxD):
  tok_sorted_P, inv_KxN, like = res
  gx = g_PxD.astype(jnp.float32)[inv_KxN].sum(axis=0)
  return gx.astype(like.dtype), None, None


_gather_pairs.defvjp(_gather_pairs_fwd, _gather_pairs_bwd)


@jax.custom_vjp
def _combine_sorted(y_sorted_PxD, inv_KxN, tok_sorted_P):
  """y_n = Σ_k y_sorted[inv[k, n]] in float32 (the pairs already weighted): the transpose of
  `_gather_pairs`, so its own transpose is the gather g[tok_sorted] (no scatter)."""
  return y_sorted_PxD.astype(jnp.float32)[inv_KxN].sum(axis=0)


def _combine_sorted_fwd(y_sorted_PxD, inv_KxN, tok_sorted_P):
  return (_combine_sorted(y_sorted_PxD, inv_KxN, tok_sorted_P),
          (tok_sorted_P, jnp.zeros((0,), y_sorted_PxD.dtype)))


def _combine_sorted_bwd(res, g_NxD):
  tok_sorted_P, like = res
  return g_NxD[tok_sorted_P].astype(like.dtype), None, None


_combine_sorted.defvjp(_combine_sorted_fwd, _combine_sorted_bwd)


def _dropless_local(x_NxD, weights_NxK, experts_NxK, valid_N, n_experts: int,
                    sorted_ffn: Callable):
  """Exact dispatch; `sorted_ffn(x_sorted_PxD, weight_sorted_P, e_sorted_P, group_sizes_E) ->
  y_sorted_PxD`, whose rows past Σ group_sizes (the padding pairs and bad ids, sorted last) must
  be zero: the grouped product's rows past Σ g are. The token gather and the combine are gathers
  forward and backward (the sort is a permutation: pair p = k·N + n sits at inv[p]).

  No `where(pair is live, y, 0)` here: inside the layer scan JAX hoists its [P, D] float32 zeros
  out of the loop as a buffer that every layer's combine then read (s3: 256 MB a layer)."""
  order, inv, e_sorted, tok_sorted, group_sizes = _sort_pairs(experts_NxK, valid_N, n_experts)
  inv_KxN = inv.reshape(experts_NxK.shape[1], -1)
  y_sorted = sorted_ffn(_gather_pairs(x_NxD, tok_sorted, inv_KxN),
                        _pair_weights(weights_NxK)[order], e_sorted, group_sizes)
  return _combine_sorted(y_sorted, inv_KxN, tok_sorted), jnp.zeros(experts_NxK.shape, jnp.bool_)


def _capacity_local(x_NxD, weights_NxK, experts_NxK, valid_N, n_experts: int, capacity: int,
                    buffer_ffn: Callable):
  """Capacity dispatch; `buffer_ffn(x_ExCxD, weight_ExC) -> y_ExCxD`. Returns (y [N, D],
  dropped [N, K])."""
  n, k = experts_NxK.shape
  _, inv, e_sorted, _, group_sizes = _sort_pairs(experts_NxK, valid_N, n_experts)
  start = jnp.cumsum(group_sizes) - group_sizes
  rank_sorted = jnp.arange(n * k) - start[jnp.minimum(e_sorted, n_experts - 1)]
  rank_P = rank_sorted[inv]
  e_P = experts_NxK.T.reshape(-1)
  valid_P = jnp.broadcast_to(valid_N[None, :], (k, n)).reshape(-1)
  kept_P = valid_P & (rank_P < capacity)
  slot_P = jnp.where(kept_P, e_P * capacity + rank_P, n_experts * capacity)
  token_P = jnp.arange(n * k) % n
  token_of_slot = jnp.full((n_experts * capacity,), n, jnp.int32).at[slot_P].set(
      token_P.astype(jnp.int32), mode="drop")
  buf = _pad_row(x_NxD)[token_of_slot].reshape(n_experts, capacity, -1)
  weight_of_slot = jnp.zeros((n_experts * capacity,), jnp.float32).at[slot_P].set(
      _pair_weights(weights_NxK), mode="drop")
  y_buf = buffer_ffn(buf, weight_of_slot.reshape(n_experts, capacity))
  # dropped and padding pairs read the zero row at slot E·C (no where: see `_dropless_local`)
  y_pairs = _pad_row(y_buf.reshape(n_experts * capacity, -1))[slot_P]
  dropped_NxK = (valid_P & ~kept_P).reshape(k, n).T
  return _combine(y_pairs, k), dropped_NxK


# --- expert-parallel exchanges (run inside shard_map) -------------------------------------------

def _ep_sorted_ffn(w1, w3, w2, *, n_experts: int, n_tokens: int, k: int, limit: float, policy: str,
                   expert_axis, n_shards: int, tensor_axis, gate_up_dtype, out_dtype):
  """`sorted_ffn` that ships sorted rows to the experts' owners and back (dropless, exact)."""
  e_loc = n_experts // n_shards
  s = n_tokens * min(k, e_loc)  # worst case rows from one device to one owner

  def sorted_ffn(x_sorted_PxD, weight_sorted_P, e_sorted_P, group_sizes_E):
    n_pairs, d = x_sorted_PxD.shape
    cnt_G = group_sizes_E.reshape(n_shards, e_loc).sum(axis=1)
    start_G = jnp.cumsum(cnt_G) - cnt_G
    slot = jnp.arange(s)
    pos_GxS = start_G[:, None] + slot[None, :]
    live_GxS = slot[None, :] < cnt_G[:, None]
    pos_GxS = jnp.where(live_GxS, pos_GxS, n_pairs)
    send_x = _pad_row(x_sorted_PxD)[pos_GxS]
    send_w = jnp.concatenate([weight_sorted_P, jnp.zeros((1,), jnp.float32)])[pos_GxS]
    e_pad = jnp.concatenate([e_sorted_P, jnp.full((1,), n_experts, e_sorted_P.dtype)])
    send_e = jnp.where(live_GxS, e_pad[pos_GxS] - jnp.arange(n_shards)[:, None] * e_loc, e_loc)
    recv_x = jax.lax.all_to_all(send_x, expert_axis, 0, 0, tiled=True).reshape(n_shards * s, d)
    recv_e = jax.lax.all_to_all(send_e, expert_axis, 0, 0, tiled=True).reshape(-1)
    recv_w = jax.lax.all_to_all(send_w, expert_axis, 0, 0, tiled=True).reshape(-1)
    order = jnp.argsort(recv_e, stable=True)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    sizes = jnp.zeros((e_loc + 1,), jnp.int32).at[recv_e].add(1)[:e_loc]
    y = grouped_ffn(recv_x[order], recv_w[order], w1, w3, w2, sizes, limit, policy,
                    gate_up_dtype, out_dtype)
    if tensor_axis is not None:
      y = jax.lax.psum(y, tensor_axis)
    y = y[inv].astype(x_sorted_PxD.dtype).reshape(n_shards, s, d)
    back = jax.lax.all_to_all(y, expert_axis, 0, 0, tiled=True).reshape(n_shards * s, d)
    owner = jnp.minimum(e_sorted_P // e_loc, n_shards - 1)
    idx = jnp.clip(owner * s + jnp.arange(n_pairs) - start_G[owner], 0, n_shards * s - 1)
    # rows past the routed pairs (padding, bad ids) read the zero row, as the local product's do
    return _pad_row(back)[jnp.where(e_sorted_P < n_experts, idx, n_shards * s)]

  return sorted_ffn


def _ep_buffer_ffn(w1, w3, w2, *, n_experts: int, limit: float, expert_axis, n_shards: int,
                   tensor_axis, gate_up_dtype, out_dtype):
  """`buffer_ffn` that ships each owner its [E/G, C, D] slice of the capacity buffer and back."""
  e_loc = n_experts // n_shards

  def buffer_ffn(buf_ExCxD, weight_ExC):
    _, c, d = buf_ExCxD.shape
    recv = jax.lax.all_to_all(buf_ExCxD.reshape(n_shards, e_loc * c, d), expert_axis, 0, 0,
                              tiled=True)
    x_loc = recv.reshape(n_shards, e_loc, c, d).transpose(1, 0, 2, 3).reshape(e_loc, -1, d)
    recv_w = jax.lax.all_to_all(weight_ExC.reshape(n_shards, e_loc * c), expert_axis, 0, 0,
                                tiled=True)
    w_loc = recv_w.reshape(n_shards, e_loc, c).transpose(1, 0, 2).reshape(e_loc, -1)
    y = batched_ffn(x_loc, w_loc, w1, w3, w2, limit, gate_up_dtype, out_dtype)
    if tensor_axis is not None:
      y = jax.lax.psum(y, tensor_axis)
    y = y.astype(buf_ExCxD.dtype).reshape(e_loc, n_shards, c, d).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(y.reshape(n_shards, e_loc * c, d), expert_axis, 0, 0, tiled=True)
    return back.reshape(n_experts, c, d)

  return buffer_ffn


# --- entry point --------------------------------------------------------------------------------

def _dispatch_shard(x_BxTxD, weights_BxTxK, experts_BxTxK, valid_BxT, w1, w3, w2, *, mode: str,
                    capacity_factor: float, limit: float, policy: str, product_dtype: str,
                    expert_axis, n_shards: int, tensor_axis):
  b, t, d = x_BxTxD.shape
  k = experts_BxTxK.shape[-1]
  n = b * t
  n_experts = w1.shape[0] * n_shards
  x = x_BxTxD.reshape(n, d)
  g = weights_BxTxK.reshape(n, k)
  e = experts_BxTxK.reshape(n, k).astype(jnp.int32)
  valid = valid_BxT.reshape(n)
  # An id outside [0, E) is dispatched like a padding pair (bucket E: sorted last, no expert) and
  # its token's output poisoned below, so it can neither land in a neighbour's group nor vanish.
  bad_id = (e < 0) | (e >= n_experts)
  e = jnp.where(bad_id, n_experts, e)
  exchange = n_shards > 1
  # The products' output dtypes: [a | u] and, unless partial sums over `tensor` follow, the
  # down-projection's (otherwise rounded after the psum).
  narrow = x.dtype if product_dtype == "compute" else jnp.dtype(jnp.float32)
  out_dt = narrow if tensor_axis is None else jnp.dtype(jnp.float32)
  dtypes = dict(gate_up_dtype=narrow, out_dtype=out_dt)
  if mode == "dropless":
    if exchange:
      ffn = _ep_sorted_ffn(w1, w3, w2, n_experts=n_experts, n_tokens=n, k=k, limit=limit,
                           policy=policy, expert_axis=expert_axis, n_shards=n_shards,
                           tensor_axis=tensor_axis, **dtypes)
    else:
      def ffn(xs, ws, es, gs):
        y = grouped_ffn(xs, ws, w1, w3, w2, gs, limit, policy, **dtypes)
        return y if tensor_axis is None else jax.lax.psum(y, tensor_axis).astype(narrow)
    y, dropped = _dropless_local(x, g, e, valid, n_experts, ffn)
  else:
    capacity = expert_capacity(n, k, n_experts, capacity_factor)
    if exchange:
      ffn = _ep_buffer_ffn(w1, w3, w2, n_experts=n_experts, limit=limit, expert_axis=expert_axis,
                           n_shards=n_shards, tensor_axis=tensor_axis, **dtypes)
    else:
      def ffn(buf, wbuf):
        y = batched_ffn(buf, wbuf, w1, w3, w2, limit, **dtypes)
        return y if tensor_axis is None else jax.lax.psum(y, tensor_axis).astype(narrow)
    y, dropped = _capacity_local(x, g, e, valid, n_experts, capacity, ffn)
  # + NaN or + 0 per token (y + 0 = y): a `where` with a [N, D] NaN operand was hoisted out of
  # the layer scan as a buffer every layer read, like the zeros of `_dropless_local`.
  y = y + jnp.where(valid & bad_id.any(axis=1), jnp.nan, 0.0)[:, None]
  return y.reshape(b, t, d), dropped.reshape(b, t, k)


def _mesh_axes(mesh, logical: str) -> tuple[str, ...] | None:
  """The mesh axes (size > 1) a logical axis maps to in this mesh, as one collective axis name
  (a tuple: the experts may be split over several axes, e.g. expert × engram), or None."""
  return sharding.mesh_axes(mesh, logical) or None


def routed_experts(x_BxTxD, weights_BxTxK, experts_BxTxK, valid_BxT, w1_ExDxF, w3_ExDxF,
                   w2_ExFxD, *, mode: str = "dropless", capacity_factor: float = 1.25,
                   swiglu_limit: float = 10.0, policy: str = "auto", product_dtype: str = "float32",
                   mesh=None):
  """Σ_{k} g_{t,k} · E_{e_{t,k}}(x_t) over the routed pairs of the valid tokens.

  Args:
    x_BxTxD: token activations in the compute dtype.
    weights_BxTxK, experts_BxTxK: routing weights and expert ids (from `moe.route`).
    valid_BxT: False for padding tokens, which are not dispatched (their routed output is 0).
    w1_ExDxF, w3_ExDxF, w2_ExFxD: routed expert weights (cast to x's dtype); w1 and w3 may be
      `gate_up_pair`'s form.
    mode: "dropless" or "capacity" (module docstring).
    policy: the op `grouped_matmul`'s policy for `dropless` ("auto" | "reference" | "kernel").
    product_dtype: "float32" or "compute": the expert products' output dtype (module docstring).
    mesh: a Mesh / AbstractMesh; None takes the context mesh (`jax.set_mesh`), none = local.
  Returns:
    (y_BxTxD float32, dropped_BxTxK bool): dropped marks valid pairs that capacity removed.
  """
  if mode not in MODES:
    raise ValueError(f"moe dispatch mode {mode!r} is not one of {MODES}")
  ids, live = _concrete(experts_BxTxK), _concrete(valid_BxT)
  if ids is not None and live is not None:
    ids = ids[live.astype(bool)]
    if ((ids < 0) | (ids >= w1_ExDxF.shape[0])).any():
      raise ValueError(f"expert ids of valid tokens must lie in [0, {w1_ExDxF.shape[0]}); got "
                       f"min {ids.min()}, max {ids.max()}")
  if product_dtype not in PRODUCT_DTYPES:
    raise ValueError(f"moe product dtype {product_dtype!r} is not one of {PRODUCT_DTYPES}")
  dispatch.check_policy("grouped_matmul", policy)
  kw = dict(mode=mode, capacity_factor=capacity_factor, limit=swiglu_limit, policy=policy,
            product_dtype=product_dtype)
  args = (x_BxTxD, weights_BxTxK, experts_BxTxK, valid_BxT, w1_ExDxF, w3_ExDxF, w2_ExFxD)
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return _dispatch_shard(*args, expert_axis=None, n_shards=1, tensor_axis=None, **kw)

  expert_axis = _mesh_axes(mesh, "expert")
  tensor_axis = _mesh_axes(mesh, "mlp")
  n_shards = sharding.axes_size(mesh, expert_axis or ())
  n_experts = w1_ExDxF.shape[0]
  if n_experts % n_shards:
    raise sharding.ShardingError(f"n_routed_experts ({n_experts}) is not divisible by the mesh's "
                                 f"axes {expert_axis} ({n_shards} ways)")
  batch_axes = sharding.batch_axes(mesh)
  n_batch = sharding.batch_ways(mesh)
  if x_BxTxD.shape[0] % n_batch:
    raise sharding.ShardingError(f"batch size {x_BxTxD.shape[0]} is not divisible by the {n_batch} "
                                 f"batch shards of the mesh axes {batch_axes}")
  row = sharding.batch_spec(mesh)
  w_in = sharding.shard_spec(mesh, ("expert", None, "mlp"))
  w1_in = (sharding.shard_spec(mesh, ("expert", None, None, "mlp"))
           if _is_pair(w1_ExDxF, w3_ExDxF) else w_in)
  w_out = sharding.shard_spec(mesh, ("expert", "mlp", None))
  body = lambda *a: _dispatch_shard(*a, expert_axis=expert_axis, n_shards=n_shards,
                                    tensor_axis=tensor_axis, **kw)
  return jax.shard_map(body, mesh=mesh, in_specs=(row, row, row, row, w1_in, w_in, w_out),
                       out_specs=(row, row), check_vma=True)(*args)
