"""Op: the routed experts' gate/up product and clamped SwiGLU × routing weight (docs/design.md §8.2).

With group g owning rows [s_g, s_g + n_g) of x (as in `grouped_matmul`) and [w1 | w3] [G, K, 2F]:

  [a | u] = x[r] · [w1 | w3][g(r)]                            float32 accumulation, `gate_up_dtype`
  h[r]    = g_r · SiLU(min(a, L)) · clip(u, −L, L)     float32 from the rounded a and u,
                                                      rounded once to x's dtype (L = limit)

returning (h [M, F], au [M, 2F]); rows past Σ n_g are 0 in both. The routing weight g_r [M] scales
the activation before the down-projection, as the official V4 `Expert` does.

The reference is the op `grouped_matmul`'s reference (`ragged_dot`) followed by `weighted_swiglu`,
the two steps the routed experts run today (the gate/up product under its own op's policy). The
dispatcher's op `grouped_swiglu`, whose kernel (`pallas_kernels/grouped_swiglu.py`) computes h in
the grouped GEMM's epilogue and keeps the backward's math: `weighted_swiglu`'s VJP from the saved
au, then the gate/up product's two backward products. Group sizes that are negative or sum past M
raise ValueError when concrete and make both outputs NaN when traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ops.grouped_matmul import grouped_matmul


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


def swiglu_cotangents(au_PxF2, weight_P, dh_PxF, limit: float):
  """(cotangent of [a | u] in float32 [P, 2F], cotangent of g [P]) of h = g · clamped_swiglu(a, u)
  for the cotangent dh of h: `weighted_swiglu`'s backward before it rounds d_au to au's dtype."""
  p, f2 = au_PxF2.shape
  f = f2 // 2
  au_Px2xF = au_PxF2.reshape(p, 2, f)
  s_PxF, pullback = jax.vjp(lambda a, u: clamped_swiglu(a, u, limit), au_Px2xF[:, 0],
                            au_Px2xF[:, 1])
  dh_PxF = dh_PxF.astype(jnp.float32)
  da_PxF, du_PxF = pullback(dh_PxF * weight_P[:, None])
  d_au = jnp.pad(da_PxF, ((0, 0), (0, f))) + jnp.pad(du_PxF, ((0, 0), (f, 0)))
  # g's cotangent Σ_f dh·s as the VJP of g -> g·s with s placed in [P, 2, F] (zeros in the u
  # half): a reduction over d_au's index space, and, inside shard_map, the psum over the mesh axes
  # that au varies over and g does not (the MLP width split over `tensor`), as autodiff has it.
  s_Px2xF = jnp.where((jnp.arange(2) == 0)[None, :, None], s_PxF[:, None, :], 0.0)
  _, weight_transpose = jax.vjp(lambda g: g[:, None, None] * s_Px2xF, weight_P)
  (d_weight,) = weight_transpose(jnp.broadcast_to(dh_PxF[:, None, :], s_Px2xF.shape))
  return d_au, d_weight


def _weighted_swiglu_bwd(limit, dtype, res, dh_PxF):
  au_PxF2, weight_P = res
  d_au, d_weight = swiglu_cotangents(au_PxF2, weight_P, dh_PxF, limit)
  # in au's dtype: a bf16 [a | u] (`product_dtype="compute"`) takes its cotangent rounded once
  # here, as the grouped product's backward would round it
  return d_au.astype(au_PxF2.dtype), d_weight


weighted_swiglu.defvjp(_weighted_swiglu_fwd, _weighted_swiglu_bwd)


def grouped_swiglu(x_sorted_PxD, w13_ExDxF2, weight_P, group_sizes_E, *, limit: float,
                   gate_up_dtype=jnp.float32):
  """(h [P, F] in x's dtype, [a | u] [P, 2F] in `gate_up_dtype`) of the rows sorted by expert
  (module docstring); w13 = [w1 | w3] [E, D, 2F] is cast to x's dtype, weight [P] is float32."""
  au = grouped_matmul(x_sorted_PxD, w13_ExDxF2, group_sizes_E, out_dtype=gate_up_dtype)
  return weighted_swiglu(au, weight_P, limit, x_sorted_PxD.dtype), au
