"""Fused single-pass mHC site, forward and backward (docs/design.md §3.2–3.3; §T5).

Under V4.1's single-pass schedule a site collapses with the PREVIOUS site's `pre`, so the expand
of the previous site, this site's coefficients and its collapse + norm all read the same streams
and can share one pass. `hc_site` is the kernel of the op `pallas_kernels.ops.mhc.hc_site` (the
tests compare them):

  X'   = expand(X, post_prev, comb_prev, F)      X' [.., n, d], X's dtype (the new streams)
  x    = rms_norm(collapse(X', pre_prev), w)     x [.., d], X's dtype (the sublayer input)
  pre, post, comb = hc_coefficients(X')          float32, this site's coefficients

Memory traffic per token: X read, F read, X' written, x written: (2n+2)·d values, half of the
unfused path's (4n+4)·d (expand, coefficients, collapse and norm each reading the streams).

Forward kernel (Triton via `pl.pallas_call`, explicit `CompilerParams`): each program takes
`block_tokens` tokens and loops over d in chunks of `block_d` twice. Pass 1 rebuilds X' and the
collapse y to get Σy², which the norm needs before any x can be written; pass 2 rebuilds them
again, writes X' and x, and accumulates the coefficient mix X'·fnᵀ (bfloat16 tensor-core dots
against fn split into three bfloat16 pieces, exact products, float32 sums) and Σx'²; the epilogue
is the coefficient kernel's (RMS, sigmoids, 20 Sinkhorn rounds in registers). Pass 2 re-reads the
program's slice of X and F, block_tokens·(n+1)·d·2 bytes, which is meant to come from L2.

Backward (custom VJP; residuals are the inputs only): the coefficient cotangents go through a
second kernel that recomputes the Sinkhorn iterates in registers (step t's input is rebuilt from
the softmax for every t, 2·iters−1 steps: O(iters²) tiny n×n work, no stored iterates) and
returns the cotangent of the logits z; the rest (expand, collapse, norm and the mix x̂·fnᵀ) is
the VJP of the op's own pieces (`ops.mhc.expand`, `collapse`, `hc_mix`), which XLA fuses. Under a
mesh the dispatcher runs forward and backward per batch shard. Token counts the blocks do not
tile are padded (logged once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.mhc import (_HIGHEST, _coefficient_rows, _col_norm, _next_pow2, _row_norm,
                                _triton_params, param_rows)
from pallas_kernels.notices import log_once
from pallas_kernels.ops import mhc as ops_mhc
from pallas_kernels.ops.norm import rms_norm

# --- forward kernel --------------------------------------------------------------------------


def _site_kernel(x_ref, f_ref, c_ref, w_ref, *refs, n: int, d: int, block_d: int, groups: int,
                 iters: int, hc_eps: float, norm_eps: float):
  *f_refs, scale_ref, base_ref, xo_ref, yo_ref, co_ref = refs
  bt = x_ref.shape[0]
  dt = xo_ref.dtype
  col = lambda k: c_ref[:, pl.ds(k, 1)]  # noqa: E731  [bt, 1] float32 per-token coefficient
  post = [col(k) for k in range(n)]
  comb = [[col(n + j * n + k) for k in range(n)] for j in range(n)]  # comb[j][k]
  pre = [col(n + n * n + i) for i in range(n)]

  def rebuild(c):
    """X' chunk (n arrays [bt, block_d], rounded to X's dtype) and the rounded collapse y."""
    f = f_ref[:, pl.ds(c * block_d, block_d)].astype(jnp.float32)
    xs = [x_ref[:, pl.ds(j * d + c * block_d, block_d)].astype(jnp.float32) for j in range(n)]
    new = []
    for k in range(n):
      m = comb[0][k] * xs[0]
      for j in range(1, n):
        m = m + comb[j][k] * xs[j]
      new.append((post[k] * f + m).astype(dt))
    y = pre[0] * new[0].astype(jnp.float32)
    for i in range(1, n):
      y = y + pre[i] * new[i].astype(jnp.float32)
    return new, y.astype(dt).astype(jnp.float32)

  def pass1(c, ss_y):
    _, y = rebuild(c)
    return ss_y + jnp.sum(y * y, axis=1, keepdims=True)

  n_chunks = d // block_d
  ss_y = jax.lax.fori_loop(0, n_chunks, pass1, jnp.zeros((bt, 1), jnp.float32))
  r = jax.lax.rsqrt(ss_y / d + norm_eps)

  def pass2(c, carry):
    acc, ss = carry
    new, y = rebuild(c)
    for k in range(n):
      xo_ref[:, pl.ds(k * d + c * block_d, block_d)] = new[k]
      v32 = new[k].astype(jnp.float32)
      for f_piece in f_refs:  # three bfloat16 pieces of fn (bfloat16 streams) or fn in float32
        fc = f_piece[pl.ds(k * d + c * block_d, block_d), :]        # [block_d, P]
        lhs = new[k] if fc.dtype == dt else v32
        acc = acc + jnp.dot(lhs, fc, precision=_HIGHEST, preferred_element_type=jnp.float32)
      ss = ss + jnp.sum(v32 * v32, axis=1, keepdims=True)
    w = w_ref[:, pl.ds(c * block_d, block_d)]
    yo_ref[:, pl.ds(c * block_d, block_d)] = ((y * r) * w).astype(yo_ref.dtype)
    return acc, ss

  p = groups * n
  acc, ss = jax.lax.fori_loop(0, n_chunks, pass2, (jnp.zeros((bt, p), jnp.float32),
                                                   jnp.zeros((bt, 1), jnp.float32)))
  co_ref[...] = _coefficient_rows(acc, ss, scale_ref[...], base_ref[...], n=n, groups=groups,
                                  k_total=n * d, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)


def _tokens_tiled(tokens: int, block_tokens: int, what: str) -> int:
  padded = pl.cdiv(tokens, block_tokens) * block_tokens
  if padded != tokens:
    log_once((what, tokens, block_tokens),
              f"{what}: {tokens} tokens are not tiled by {block_tokens}; padding to {padded}")
  return padded


def _pad_rows(a, padded):
  return a if a.shape[0] == padded else jnp.pad(a, ((0, padded - a.shape[0]),) + ((0, 0),) *
                                                (a.ndim - 1))


def _site_call(X, F, post, comb, pre, w_row, *params, n, d, iters, hc_eps, norm_eps,
               block_tokens, block_d, interpret, num_warps, num_stages):
  """The forward kernel on one shard: X [.., n, d] -> (X', x, coefficient rows [.., P])."""
  *f_parts, scale_row, base_row = params
  lead = X.shape[:-2]
  tokens = int(np.prod(lead))
  groups = _next_pow2(2 + n)
  p = groups * n
  q = _next_pow2(n + n * n + n)
  small = jnp.concatenate([post.reshape(tokens, n), comb.reshape(tokens, n * n),
                           pre.reshape(tokens, n)], axis=1).astype(jnp.float32)
  small = jnp.pad(small, ((0, 0), (0, q - small.shape[1])))
  padded = _tokens_tiled(tokens, block_tokens, "hc_site")
  x = _pad_rows(X.reshape(tokens, n * d), padded)
  f = _pad_rows(F.reshape(tokens, d), padded)
  small = _pad_rows(small, padded)
  kernel = functools.partial(_site_kernel, n=n, d=d, block_d=block_d, groups=groups, iters=iters,
                             hc_eps=hc_eps, norm_eps=norm_eps)
  row = lambda width: pl.BlockSpec((block_tokens, width), lambda i: (i, 0))  # noqa: E731
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0, 0))  # noqa: E731
  Xo, xo, co = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((padded, n * d), X.dtype),
                 jax.ShapeDtypeStruct((padded, d), X.dtype),
                 jax.ShapeDtypeStruct((padded, p), jnp.float32)),
      grid=(padded // block_tokens,),
      in_specs=[row(n * d), row(d), row(q), whole(w_row)] + [whole(a) for a in params],
      out_specs=(row(n * d), row(d), row(p)),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret,
      name="mhc_site",
  )(x, f, small, w_row, *params)
  return (Xo[:tokens].reshape(X.shape), xo[:tokens].reshape(F.shape),
          co[:tokens].reshape(*lead, p))


@functools.partial(jax.jit, static_argnames=("iters", "hc_eps", "norm_eps", "block_tokens",
                                             "block_d", "interpret", "num_warps", "num_stages"))
def hc_site_forward(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
                    norm_weight, *, iters: int, hc_eps: float, norm_eps: float,
                    block_tokens: int = 64, block_d: int = 64, interpret: bool = False,
                    num_warps: int = 8, num_stages: int = 2):
  """(X', x, pre, post, comb) of one site from the fused forward kernel (see module doc)."""
  *_, n, d = X_BxTxNxD.shape
  if fn.shape != ((2 + n) * n, n * d):
    raise ValueError(f"fn has shape {fn.shape}, expected {((2 + n) * n, n * d)}")
  if F_BxTxD.shape != X_BxTxNxD.shape[:-2] + (d,):
    raise ValueError(f"F has shape {F_BxTxD.shape}, expected {X_BxTxNxD.shape[:-2] + (d,)}")
  bd = min(block_d, d & -d)  # the largest power of two dividing d, capped
  if bd < 16:
    raise ValueError(f"hidden size {d} has no power-of-two chunk ≥ 16 for the site kernel")
  f_parts, scale_row, base_row = param_rows(fn, base, scale, n, X_BxTxNxD.dtype)
  w_row = norm_weight.astype(jnp.float32)[None, :]
  call = functools.partial(_site_call, n=n, d=d, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                           block_tokens=block_tokens, block_d=bd, interpret=interpret,
                           num_warps=num_warps, num_stages=num_stages)
  params = (*f_parts, scale_row, base_row)
  Xn, x, co = call(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, w_row, *params)
  co = co.reshape(*co.shape[:-1], -1, n)
  return Xn, x, co[..., 0, :], co[..., 1, :], co[..., 2:2 + n, :]


# --- backward: Sinkhorn recomputed in registers ------------------------------------------------


def _sinkhorn_bwd_kernel(z_ref, g_ref, o_ref, *, n: int, groups: int, iters: int, hc_eps: float):
  bt = z_ref.shape[0]
  z3 = z_ref[...].reshape(bt, groups, n)
  g3 = g_ref[...].reshape(bt, groups, n)
  group = jax.lax.broadcasted_iota(jnp.int32, (bt, groups, n), 1)
  is_comb = (group >= 2) & (group < 2 + n)

  sig = 1.0 / (1.0 + jnp.exp(-z3))
  dsig = sig * (1.0 - sig)
  g_gates = jnp.where(group == 0, g3 * dsig, jnp.where(group == 1, 2.0 * g3 * dsig, 0.0))

  e = jnp.exp(z3 - jnp.max(z3, axis=2, keepdims=True))
  prob = e / jnp.sum(e, axis=2, keepdims=True)
  c0 = jnp.where(is_comb, prob + hc_eps, 0.0)
  steps = 2 * iters - 1  # step t normalises columns (t even) or rows (t odd)

  def pair(_, c):  # steps 2m and 2m + 1
    return _row_norm(_col_norm(c, hc_eps), hc_eps)

  def norm_bwd(c, gc, axis):  # c' = c / (Σ_axis c + eps): gc = (gc' − Σ_axis gc'·c') / (Σ + eps)
    s = jnp.sum(c, axis=axis, keepdims=True) + hc_eps
    return (gc - jnp.sum(gc * (c / s), axis=axis, keepdims=True)) / s

  def back(i, gc):
    t = steps - 1 - i
    # The input of step t, rebuilt from the softmax: t // 2 pairs, then one column step if t is
    # odd. (Parity by bit operations: Triton's lowering of `%` rejects this loop index.)
    odd = jax.lax.bitwise_and(t, 1) == 1
    c = jax.lax.fori_loop(0, jax.lax.shift_right_logical(t, 1), pair, c0)
    c = jnp.where(odd, _col_norm(c, hc_eps), c)
    gc = jnp.where(odd, norm_bwd(c, gc, 2), norm_bwd(c, gc, 1))
    return jnp.where(is_comb, gc, 0.0)  # padding groups carry nothing (their c is 0)

  gc = jax.lax.fori_loop(0, steps, back, jnp.where(is_comb, g3, 0.0))
  g_soft = prob * (gc - jnp.sum(gc * prob, axis=2, keepdims=True))
  o_ref[...] = (g_gates + jnp.where(is_comb, g_soft, 0.0)).reshape(bt, groups * n)


def _sinkhorn_bwd_call(z, g, *, n, iters, hc_eps, block_tokens, interpret):
  """z, g [.., (2+n)n] -> dL/dz [.., (2+n)n] on one shard."""
  lead, m = z.shape[:-1], z.shape[-1]
  tokens = int(np.prod(lead))
  groups = _next_pow2(2 + n)
  p = groups * n
  padded = _tokens_tiled(tokens, block_tokens, "hc_site backward")
  pad = lambda a: _pad_rows(jnp.pad(a.reshape(tokens, m), ((0, 0), (0, p - m))), padded)  # noqa
  row = pl.BlockSpec((block_tokens, p), lambda i: (i, 0))
  out = pl.pallas_call(
      functools.partial(_sinkhorn_bwd_kernel, n=n, groups=groups, iters=iters, hc_eps=hc_eps),
      out_shape=jax.ShapeDtypeStruct((padded, p), jnp.float32),
      grid=(padded // block_tokens,),
      in_specs=[row, row],
      out_specs=row,
      compiler_params=None if interpret else _triton_params(4, 1),
      interpret=interpret,
      name="mhc_sinkhorn_bwd",
  )(pad(z), pad(g))
  return out[:tokens, :m].reshape(*lead, m)


def sinkhorn_gates_vjp(z, g, *, n: int, iters: int, hc_eps: float, block_tokens: int = 64,
                       interpret: bool = False):
  """dL/dz for (pre, post, comb)(z) of §3.2, z and g packed as [.., pre n | post n | comb n·n]."""
  call = functools.partial(_sinkhorn_bwd_call, n=n, iters=iters, hc_eps=hc_eps,
                           block_tokens=block_tokens, interpret=interpret)
  return call(z.astype(jnp.float32), g.astype(jnp.float32))


def _site_math(X, F, post, comb, pre, w, fn, *, norm_eps):
  """The site without the gates, from the op's pieces: (X', x, mix), for the backward's VJP."""
  Xn = ops_mhc.expand(X, post, comb, F)
  x = rms_norm(ops_mhc.collapse(Xn, pre), w, norm_eps)
  return Xn, x, ops_mhc.hc_mix(Xn, fn, norm_eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _site(X, F, post, comb, pre, fn, base, scale, w, static):
  iters, hc_eps, norm_eps, interpret = static
  return hc_site_forward(X, F, post, comb, pre, fn, base, scale, w, iters=iters, hc_eps=hc_eps,
                         norm_eps=norm_eps, interpret=interpret)


def _site_fwd(X, F, post, comb, pre, fn, base, scale, w, static):
  return _site(X, F, post, comb, pre, fn, base, scale, w, static), (X, F, post, comb, pre, fn,
                                                                     base, scale, w)


def _site_bwd(static, res, g):
  iters, hc_eps, norm_eps, interpret = static
  X, F, post, comb, pre, fn, base, scale, w = res
  gXn, gx, gpre, gpost, gcomb = g
  n = X.shape[-2]
  (_, _, mix), vjp = jax.vjp(functools.partial(_site_math, norm_eps=norm_eps),
                             X, F, post, comb, pre, w, fn)
  s = scale.astype(jnp.float32)
  scale_cols = jnp.concatenate([jnp.full((n,), s[0]), jnp.full((n,), s[1]),
                                jnp.full((n * n,), s[2])])
  z = mix * scale_cols + base.astype(jnp.float32)
  g_out = jnp.concatenate([gpre, gpost, gcomb.reshape(*gcomb.shape[:-2], n * n)], axis=-1)
  gz = sinkhorn_gates_vjp(z, g_out, n=n, iters=iters, hc_eps=hc_eps, interpret=interpret)
  lead_axes = tuple(range(gz.ndim - 1))
  g_base = jnp.sum(gz, axis=lead_axes)
  gzm = jnp.sum(gz * mix, axis=lead_axes)
  g_scale = jnp.stack([jnp.sum(gzm[:n]), jnp.sum(gzm[n:2 * n]), jnp.sum(gzm[2 * n:])])
  gX, gF, gpost_p, gcomb_p, gpre_p, gw, gfn = vjp((gXn, gx, gz * scale_cols))
  return (gX, gF, gpost_p, gcomb_p, gpre_p, gfn, g_base.astype(base.dtype),
          g_scale.astype(scale.dtype), gw)


_site.defvjp(_site_fwd, _site_bwd)


def unsupported_reason(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
                       norm_weight, **_) -> str | None:
  """Why the kernel cannot take these shapes (None if it can)."""
  *_, n, d = X_BxTxNxD.shape
  if fn.shape != ((2 + n) * n, n * d):
    return f"fn has shape {fn.shape}, expected {((2 + n) * n, n * d)}"
  if min(64, d & -d) < 16:
    return f"hidden size {d} has no power-of-two chunk ≥ 16 for the site kernel"
  return None


def hc_site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale, norm_weight,
            *, iters: int, hc_eps: float, norm_eps: float, interpret: bool | None = None):
  """Kernel of the op `hc_site`: (X', x, pre, post, comb), differentiable.

  `interpret=None` interprets on CPU and compiles (Triton) on GPU.
  """
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return _site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
               norm_weight, (iters, hc_eps, norm_eps, interpret))
