"""The mHC site from fused XLA streaming and a Pallas Sinkhorn, with hand VJPs (docs/design.md §3.2–3.3; §T5).

The same functions as the model's references (`layers.mhc.expand`, `collapse`,
`hc_coefficients`, `hc_site`; the tests compare them), written so that the GPU runs a few
memory-bound fusions and one small kernel instead of per-token tiny GEMMs and a launch-bound loop:

- `expand` X'_k = post_k·F + Σ_j comb[j, k]·X_j and `collapse` y = Σ_i pre_i·X_i are n = hc_mult
  unrolled broadcast multiply-adds (the references' einsums over a 4-wide axis lower to batched
  SGEMMs of 4 × 4 by 4 × d per token: 0.76 ms forward per s3 site against 0.13 ms of traffic,
  benchmarks/RESULTS.md). Their custom VJPs are the same kind of code: gX_j = Σ_k comb[j, k]·g_k
  and gF = Σ_k post_k·g_k elementwise, gcomb[j, k] = Σ_d X_j·g_k and gpost_k = Σ_d F·g_k as
  row reductions over d (jax's autodiff of the broadcast form measured slower than its forward).
- `gates` (sigmoids + the Sinkhorn projection, z [.., (2+n)n] -> pre | post | comb) is one Triton
  kernel with the iterations in registers (`pallas_kernels.mhc.gate_rows`), and its backward the
  recomputing kernel of `pallas_kernels.mhc_site` (no stored iterates). The reference's
  `fori_loop` of [T, 4, 4] reductions is a device loop of small launches (0.64 ms forward for
  1 MB of data); written as unrolled XLA code it is ~4,000 tiny ops whose CPU compile alone
  took 3 minutes. Both kernels run per batch shard under a mesh (`sharded.over_batch`).
- `hc_coefficients` is the reference's mix GEMM (x̂ @ fnᵀ, float32, a real [T, n·d] × [n·d, (2+n)n]
  product) and RMS, then `gates`; `hc_site` composes the pieces like the reference.

Float32 math throughout, outputs in the references' dtypes; the sums are the references' in
another order (ulp-level differences). `interpret=None` interprets the kernels on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.mhc import _next_pow2, _triton_params, gate_rows
from pallas_kernels.mhc_site import sinkhorn_gates_vjp
from pallas_kernels.sharded import over_batch

_HIGHEST = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


# --- expand ------------------------------------------------------------------------------------

def _expand_f32(X, post, comb, F):
  n = X.shape[-2]
  X, post, comb, F = (a.astype(_F32) for a in (X, post, comb, F))
  out = post[..., :, None] * F[..., None, :]
  for j in range(n):
    out = out + comb[..., j, :, None] * X[..., j:j + 1, :]
  return out


@jax.custom_vjp
def expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, f_out_BxTxD):
  """New streams X'_k = post_k · F + Σ_j comb[j, k] · X_j, X's dtype out (`layers.mhc.expand`)."""
  return _expand_f32(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, f_out_BxTxD).astype(X_BxTxNxD.dtype)


def _expand_fwd(X, post, comb, F):
  return expand(X, post, comb, F), (X, post, comb, F)


def _expand_bwd(res, g):
  X, post, comb, F = res
  n = X.shape[-2]
  g = g.astype(_F32)
  c = comb.astype(_F32)
  p = post.astype(_F32)
  X32, F32 = X.astype(_F32), F.astype(_F32)
  gX = c[..., :, 0, None] * g[..., 0:1, :]
  gF = p[..., 0, None] * g[..., 0, :]
  for k in range(1, n):
    gX = gX + c[..., :, k, None] * g[..., k:k + 1, :]
    gF = gF + p[..., k, None] * g[..., k, :]
  gpost = jnp.sum(g * F32[..., None, :], axis=-1)
  gcomb = jnp.stack([jnp.sum(g * X32[..., j:j + 1, :], axis=-1) for j in range(n)], axis=-2)
  return (gX.astype(X.dtype), gpost.astype(post.dtype), gcomb.astype(comb.dtype),
          gF.astype(F.dtype))


expand.defvjp(_expand_fwd, _expand_bwd)


# --- collapse ----------------------------------------------------------------------------------

@jax.custom_vjp
def collapse(X_BxTxNxD, pre_BxTxN):
  """Sublayer input Σ_i pre_i · X_i [B, T, d], X's dtype out; pre may be [n] (`layers.mhc.collapse`)."""
  n = X_BxTxNxD.shape[-2]
  X = X_BxTxNxD.astype(_F32)
  pre = pre_BxTxN.astype(_F32)
  y = pre[..., 0, None] * X[..., 0, :]
  for i in range(1, n):
    y = y + pre[..., i, None] * X[..., i, :]
  return y.astype(X_BxTxNxD.dtype)


def _collapse_fwd(X, pre):
  return collapse(X, pre), (X, pre)


def _collapse_bwd(res, g):
  X, pre = res
  g = g.astype(_F32)
  gX = pre.astype(_F32)[..., :, None] * g[..., None, :]
  gpre = jnp.sum(X.astype(_F32) * g[..., None, :], axis=-1)
  extra = gpre.ndim - pre.ndim  # pre broadcast over leading axes: sum them out
  gpre = jnp.sum(gpre, axis=tuple(range(extra))) if extra else gpre
  return jnp.broadcast_to(gX, X.shape).astype(X.dtype), gpre.astype(pre.dtype)


collapse.defvjp(_collapse_fwd, _collapse_bwd)


# --- coefficients ------------------------------------------------------------------------------

def _gates_kernel(z_ref, o_ref, *, n: int, groups: int, iters: int, hc_eps: float):
  o_ref[...] = gate_rows(z_ref[...], n=n, groups=groups, iters=iters, hc_eps=hc_eps)


def _gates_call(z, *, n, iters, hc_eps, block_tokens, interpret):
  """z [.., (2+n)n] -> packed (pre | post | comb) [.., (2+n)n] on one shard."""
  lead, m = z.shape[:-1], z.shape[-1]
  tokens = int(np.prod(lead))
  groups = _next_pow2(2 + n)
  p = groups * n
  padded = pl.cdiv(tokens, block_tokens) * block_tokens
  zp = jnp.pad(z.reshape(tokens, m), ((0, padded - tokens), (0, p - m)))
  row = pl.BlockSpec((block_tokens, p), lambda i: (i, 0))
  out = pl.pallas_call(
      functools.partial(_gates_kernel, n=n, groups=groups, iters=iters, hc_eps=hc_eps),
      out_shape=jax.ShapeDtypeStruct((padded, p), _F32),
      grid=(padded // block_tokens,),
      in_specs=[row],
      out_specs=row,
      compiler_params=None if interpret else _triton_params(4, 1),
      interpret=interpret,
      name="mhc_gates",
  )(zp)
  return out[:tokens, :m].reshape(*lead, m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gates(z, static):
  """(pre | post | comb rows) [.., (2+n)n] from the logits z of §3.2 (module doc), float32."""
  n, iters, hc_eps, block_tokens, interpret = static
  call = functools.partial(_gates_call, n=n, iters=iters, hc_eps=hc_eps,
                           block_tokens=block_tokens, interpret=interpret)
  return over_batch(call, [True])(z.astype(_F32))


def _gates_fwd(z, static):
  return gates(z, static), z


def _gates_bwd(static, z, g):
  n, iters, hc_eps, block_tokens, interpret = static
  return (sinkhorn_gates_vjp(z, g, n=n, iters=iters, hc_eps=hc_eps, block_tokens=block_tokens,
                             interpret=interpret),)


gates.defvjp(_gates_fwd, _gates_bwd)


def _interpret(interpret):
  return jax.default_backend() == "cpu" if interpret is None else interpret


def hc_coefficients(X_BxTxNxD, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float,
                    block_tokens: int = 16, interpret: bool | None = None):
  """(pre, post, comb) of one site, float32 (`layers.mhc.hc_coefficients`)."""
  *lead, n, d = X_BxTxNxD.shape
  x = X_BxTxNxD.reshape(*lead, n * d).astype(_F32)
  rho = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + norm_eps)
  mix = jnp.einsum("...k,mk->...m", x, fn.astype(_F32), precision=_HIGHEST) * rho
  s = scale.astype(_F32)
  scale_cols = jnp.concatenate([jnp.full((n,), s[0]), jnp.full((n,), s[1]),
                                jnp.full((n * n,), s[2])])
  out = gates(mix * scale_cols + base.astype(_F32),
              (n, iters, hc_eps, block_tokens, _interpret(interpret)))
  return out[..., :n], out[..., n:2 * n], out[..., 2 * n:].reshape(*lead, n, n)


# --- the single-pass site ----------------------------------------------------------------------

def _rms_norm(x, weight, eps):
  x32 = x.astype(_F32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (y * weight.astype(_F32)).astype(x.dtype)


def hc_site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
            norm_weight, *, iters: int, hc_eps: float, norm_eps: float, block_tokens: int = 16,
            interpret: bool | None = None):
  """(X', x, pre', post', comb') of one single-pass site (`layers.mhc.hc_site`)."""
  X_new = expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, F_BxTxD)
  x = _rms_norm(collapse(X_new, pre_BxTxN), norm_weight, norm_eps)
  return (X_new, x, *hc_coefficients(X_new, fn, base, scale, iters=iters, hc_eps=hc_eps,
                                     norm_eps=norm_eps, block_tokens=block_tokens,
                                     interpret=interpret))


def unsupported_reason(*args, **kwargs) -> str | None:
  """None: XLA code and a Triton kernel on [tokens, (2+n)n] logits take every shape the
  reference takes (Triton on a GPU, interpreted on the CPU)."""
  return None
