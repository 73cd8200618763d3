"""The single-pass mHC site as Triton kernels, forward and backward (docs/design.md §3.2–3.3; §T5; issue 27).

A kernel of the op `hc_site` (`pallas_kernels.ops.mhc.hc_site`, whose docstring has the
equations; the tests compare them), the issue's single-pass site: the streams X and the sublayer
output F read once a pass, X' and the next sublayer input x written once, the Sinkhorn in
registers, a backward that recomputes instead of storing. Not yet in the dispatcher's row (its
default stays `pallas_kernels.mhc.hc_site` until a GPU times both: benchmarks/mhc_moe_gpu.py
--only=site). Per token, with X [n, d] the streams, F [d] the sublayer output and (post, comb,
pre) the previous site's coefficients:

  X'_k = post_k F + Σ_j comb[j, k] X_j     float32 (`_expand_f32`'s order), stored in X's dtype
  x̂    = X' as stored, flattened            the mix y = x̂ · fnᵀ [m = (2+n)n] and Σ x̂²
  c    = Σ_i pre_i X'_i                     float32, and Σ c²
  x    = c · rsqrt(mean(c²) + eps) · w      float32 (the sublayer input)

Forward (`_fwd_kernel`): a program takes `block_tokens` tokens and loops over d in chunks of
`block_d` twice, and within a chunk over the n streams. Pass 1 computes X' (written), the mix
with tensor-core dots (bfloat16 streams: fn as three exact bfloat16 terms like the op's
`_mix_bf16`, one float32 accumulator each, summed in its order; float32 streams: one IEEE
float32 dot), Σ x̂² and Σ c². Pass 2 rebuilds X' and c from the program's slice of X and F
(block_tokens·(n+1)·d values, read again from L2) and writes x, once the rms factor is known.
A stats row [.., S] leaves with the mix y (columns < m), mean(x̂²) + eps (column m) and
mean(c²) + eps (column m + 1). The gates (sigmoids, 20 Sinkhorn rounds) are
`pallas_kernels.mhc.gates` on the [tokens, m] logits, XLA code between (a few [tokens, m] ops).

Backward (custom VJP, residuals: the inputs, X' and the stats row): the gates' backward kernel
gives the cotangent of the mix y and of mean(x̂²) by autodiff of that XLA code; then
`_bwd_kernel`, again two passes over d per token block: pass 1 the norm's row sum Σ (gx·w)·c,
pass 2 everything else from X and F re-read (X' and c rebuilt bit for bit as in the forward):

  gc    = (gx·w)·r + k·c                    the norm's VJP (r, k per token)
  gX'_k = gX'_k(in) + (gy·fn)_k + 2 g_ms/(n·d) x̂_k + pre_k gc      float32, one rounding less
          than the op (its cotangents of a bfloat16 X' are summed in bfloat16)
  gX_j  = Σ_k comb[j, k] gX'_k,  gF = Σ_k post_k gX'_k,  gpost_k = Σ_d gX'_k F,
  gcomb[j, k] = Σ_d gX'_k X_j,  gpre_i = Σ_d X'_i gc,  the block's Σ_tokens gx·c·r (d norm_weight)

(gy·fn for bfloat16 streams: g₁f₁ + g₁f₂ + g₂f₁ in bfloat16 terms, the op's `_mix_bf16_bwd`). The
parameter gradient d fn = gyᵀ x̂ is one XLA product over the tokens reading X' (that VJP's form),
d norm_weight the sum of the blocks' rows. Nothing of the Sinkhorn iterates is stored.

Bytes per token (the minimum the issue counts): forward reads X, F, writes X', x; backward reads
X, F, gX', gx, X' (the d fn product) and writes gX, gF; at s3 with bfloat16 streams
(n = 4, d = 1024) 22·d forward and 40·d backward bytes. The second pass of each kernel re-reads
its block's X and F (backward: and gx), from L2 where they are still there, else from memory: up
to 10·d (backward 14·d) bytes a token more than that count. At s3 a 64-token block's slice is
640 kB (backward 900 kB), one block per SM 84 MB (120 MB) against 50 MB of L2: smaller blocks fit
it, larger ones read fn's rows (three [n·d, 32] bfloat16 terms, from L2) for more tokens each.

Tiles: 64 tokens × 32 channels, 8 warps, 2 stages (defaults) compile without spills for both
kernels and both stream dtypes (ptxas -v for sm_90a through Triton 3.6 on the CPU host: forward
146 / backward 243 registers for bfloat16 streams); 64 × 64, 128 × 32 and 32 × 32 backward spill.
Not yet timed on a GPU: `benchmarks/mhc_moe_gpu.py --fused-variants` times other tiles.

`interpret=None` interprets on the CPU and compiles with Triton on the GPU. Token counts the
blocks do not tile are padded (logged once); Triton blocks are powers of two, so on the GPU n must
be one (the gate kernels' rows), and d needs a power-of-two chunk of at least 16
(`unsupported_reason`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels.mhc import (_interpret, _next_pow2, _tokens_tiled, _triton_params,
                                 coefficients_of_mix, unsupported_reason as gates_unsupported)
from pallas_kernels.ops.mhc import MIX, _bf16_terms

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def _widths(n: int) -> tuple[int, int, int]:
  """(m, S, Q): mix columns (2+n)n; the stats / fn row width (m + 2 columns, at least 16: a
  Triton dot's smallest dimension); the per-token coefficient row width (post, comb, pre and two
  scalars)."""
  m = (2 + n) * n
  return m, max(16, _next_pow2(m + 2)), _next_pow2(2 * n + n * n + 2)


def _col(co_ref, i):
  """[bt, 1] column i (static or traced) of the coefficient rows: post_k at k, comb[j, k] at
  n + j·n + k, pre_k at n + n² + k, then (backward) mean(c²) + eps and 2 g_ms / (n·d)."""
  return co_ref[:, pl.ds(i, 1)]


def _chunk(x_ref, f_ref, c, *, n, d, bd):
  """Chunk c of F and of the streams X_j, float32 [bt, bd] each."""
  f = f_ref[:, pl.ds(c * bd, bd)].astype(_F32)
  return f, [x_ref[:, pl.ds(j * d + c * bd, bd)].astype(_F32) for j in range(n)]


def _stream(co_ref, f, xs, k, *, n, dt):
  """X'_k of a chunk as stored (X's dtype): post_k F + Σ_j comb[j, k] X_j in the op's order."""
  out = _col(co_ref, k) * f
  for j in range(n):
    out = out + _col(co_ref, n + j * n + k) * xs[j]
  return out.astype(dt)


# The streams k are a loop inside each chunk, not unrolled: unrolled, each stream was a load site
# of its own of the fn rows (three terms), whose 64-bit pointer tiles Triton hoists out of the
# loop over d; the forward took 255 registers and spilled at 32 × 32 tiles, the backward took
# 253-255 at every tile size tried and spilled at all but 16 × 32 (ptxas -v for sm_90a, Triton
# 3.6, 4 and 8 warps).


# --- forward -----------------------------------------------------------------------------------

def _fwd_kernel(x_ref, f_ref, co_ref, w_ref, *refs, n: int, d: int, bd: int, norm_eps: float):
  *fn_refs, xo_ref, yo_ref, st_ref = refs
  bt, s = st_ref.shape
  m = (2 + n) * n
  dt = xo_ref.dtype
  zero_tile = jnp.zeros((bt, bd), _F32)

  def pass1(c, carry):
    accs, ssx, ssc = carry
    f, xs = _chunk(x_ref, f_ref, c, n=n, d=d, bd=bd)

    def stream(k, carry):
      accs, ssx, y = carry
      new = _stream(co_ref, f, xs, k, n=n, dt=dt)
      cols = pl.ds(k * d + c * bd, bd)
      xo_ref[:, cols] = new
      v = new.astype(_F32)
      if dt == jnp.bfloat16:   # three exact bfloat16 terms of fn, one accumulator each
        accs = tuple(a + jnp.dot(new, ref[cols, :], preferred_element_type=_F32)
                     for a, ref in zip(accs, fn_refs))
      else:
        accs = (accs[0] + jnp.dot(v, fn_refs[0][cols, :], precision=_HIGHEST,
                                  preferred_element_type=_F32),)
      return (accs, ssx + jnp.sum(v * v, axis=1, keepdims=True),
              y + _col(co_ref, n + n * n + k) * v)          # the collapse, the op's order

    accs, ssx, y = jax.lax.fori_loop(0, n, stream, (accs, ssx, zero_tile))
    return accs, ssx, ssc + jnp.sum(y * y, axis=1, keepdims=True)

  zero = jnp.zeros((bt, 1), _F32)
  accs, ssx, ssc = jax.lax.fori_loop(
      0, d // bd, pass1, ((jnp.zeros((bt, s), _F32),) * len(fn_refs), zero, zero))
  mean_c = ssc / d + norm_eps
  r = jax.lax.rsqrt(mean_c)

  def pass2(c, _):
    f, xs = _chunk(x_ref, f_ref, c, n=n, d=d, bd=bd)
    y = jax.lax.fori_loop(0, n, lambda k, y: y + _col(co_ref, n + n * n + k) * _stream(
        co_ref, f, xs, k, n=n, dt=dt).astype(_F32), zero_tile)
    yo_ref[:, pl.ds(c * bd, bd)] = (y * r) * w_ref[:, pl.ds(c * bd, bd)]
    return 0

  jax.lax.fori_loop(0, d // bd, pass2, 0)
  mix = accs[0]
  for a in accs[1:]:           # (y₁ + y₂) + y₃, the op's order
    mix = mix + a
  col = jax.lax.broadcasted_iota(jnp.int32, (bt, s), 1)
  st_ref[...] = (mix + jnp.where(col == m, ssx / (n * d) + norm_eps, 0.0)
                 + jnp.where(col == m + 1, mean_c, 0.0))


def _rows(X, F, post, comb, pre, extra, *, block_tokens, q):
  """X [tokens, n·d], F [tokens, d] and the coefficient rows [tokens, Q], padded to the blocks."""
  *lead, n, d = X.shape
  tokens = int(np.prod(lead))
  padded = _tokens_tiled(tokens, block_tokens, "hc_site (fused)")
  co = jnp.concatenate([post.reshape(tokens, n), comb.reshape(tokens, n * n),
                        pre.reshape(tokens, n), *extra], axis=1).astype(_F32)
  # Padding tokens: X = F = 0, so X' = 0 and c = 0 whatever their coefficients; ones keep the
  # backward's rsqrt(mean(c²) + eps) finite there (0 · inf would spread NaN into d norm_weight).
  return (_pad_rows(X.reshape(tokens, n * d), padded), _pad_rows(F.reshape(tokens, d), padded),
          _pad_rows(jnp.pad(co, ((0, 0), (0, q - co.shape[1]))), padded, 1.0), tokens, padded)


def _pad_rows(a, padded, value=0.0):
  return a if a.shape[0] == padded else jnp.pad(a, ((0, padded - a.shape[0]), (0, 0)),
                                                constant_values=value)


def _unpad(a, tokens):
  return a if a.shape[0] == tokens else a[:tokens]


def _fn_terms(fn, s, dt):
  """fn [m, n·d] as [S, n·d] rows: three bfloat16 terms (bfloat16 streams) or float32."""
  fn = jnp.pad(fn.astype(_F32), ((0, s - fn.shape[0]), (0, 0)))
  return _bf16_terms(fn, 3) if dt == jnp.bfloat16 else [fn]


def _forward(X, F, post, comb, pre, fn, w, static):
  norm_eps, bt, bd, interpret, num_warps, num_stages = static
  *lead, n, d = X.shape
  m, s, q = _widths(n)
  x, f, co, tokens, padded = _rows(X, F, post, comb, pre, (), block_tokens=bt, q=q)
  fn_cols = [t.T for t in _fn_terms(fn, s, X.dtype)]   # [n·d, S]
  row = lambda width: pl.BlockSpec((bt, width), lambda i: (i, 0))  # noqa: E731
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0, 0))  # noqa: E731
  w_row = w.astype(_F32)[None, :]
  Xo, xo, st = pl.pallas_call(
      functools.partial(_fwd_kernel, n=n, d=d, bd=bd, norm_eps=norm_eps),
      out_shape=(jax.ShapeDtypeStruct((padded, n * d), X.dtype),
                 jax.ShapeDtypeStruct((padded, d), _F32),
                 jax.ShapeDtypeStruct((padded, s), _F32)),
      grid=(padded // bt,),
      in_specs=[row(n * d), row(d), row(q), whole(w_row)] + [whole(a) for a in fn_cols],
      out_specs=(row(n * d), row(d), row(s)),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret,
      name="mhc_site_fwd",
  )(x, f, co, w_row, *fn_cols)
  return (_unpad(Xo, tokens).reshape(X.shape), _unpad(xo, tokens).reshape(F.shape),
          _unpad(st, tokens).reshape(*lead, s))


# --- backward ----------------------------------------------------------------------------------

def _bwd_kernel(x_ref, f_ref, gxn_ref, gx_ref, co_ref, gy_ref, w_ref, *refs, n: int, d: int,
                bd: int):
  *fn_refs, gX_ref, gF_ref, gco_ref, gw_ref = refs
  bt, q = gco_ref.shape
  dt = x_ref.dtype
  zero_tile = jnp.zeros((bt, bd), _F32)
  mean_c, a2 = _col(co_ref, 2 * n + n * n), _col(co_ref, 2 * n + n * n + 1)
  r = jax.lax.rsqrt(mean_c)          # the forward's factor, bit for bit

  def collapsed(c):
    f, xs = _chunk(x_ref, f_ref, c, n=n, d=d, bd=bd)
    y = jax.lax.fori_loop(0, n, lambda k, y: y + _col(co_ref, n + n * n + k) * _stream(
        co_ref, f, xs, k, n=n, dt=dt).astype(_F32), zero_tile)
    return f, xs, y

  def pass1(c, acc):
    _, _, y = collapsed(c)
    u = gx_ref[:, pl.ds(c * bd, bd)] * w_ref[:, pl.ds(c * bd, bd)]
    return acc + jnp.sum(u * y, axis=1, keepdims=True)

  g_r = jax.lax.fori_loop(0, d // bd, pass1, jnp.zeros((bt, 1), _F32))
  # rsqrt's VJP as autodiff writes it (-0.5 · r / mean), then mean's and the square's.
  k_c = (g_r * (-0.5 * r / mean_c)) / d * 2.0
  gy = gy_ref[...]
  if dt == jnp.bfloat16:             # g = g₁ + g₂ + …: bfloat16 terms as `_mix_bf16_bwd`
    g1, g2 = _bf16_terms(gy, 2)
  col = jax.lax.broadcasted_iota(jnp.int32, (bt, q), 1)

  def pass2(c, gco):
    f, xs, y = collapsed(c)
    gx = gx_ref[:, pl.ds(c * bd, bd)]
    gc = (gx * w_ref[:, pl.ds(c * bd, bd)]) * r + k_c * y
    gw_ref[:, pl.ds(c * bd, bd)] = jnp.sum(gx * (y * r), axis=0, keepdims=True)

    def stream(k, carry):
      gXs, gF, gco = carry
      v = _stream(co_ref, f, xs, k, n=n, dt=dt).astype(_F32)
      cols = pl.ds(k * d + c * bd, bd)
      if dt == jnp.bfloat16:
        f1, f2 = fn_refs[0][:, cols], fn_refs[1][:, cols]
        dx = (jnp.dot(g1, f1, preferred_element_type=_F32)
              + jnp.dot(g1, f2, preferred_element_type=_F32)
              + jnp.dot(g2, f1, preferred_element_type=_F32))
      else:
        dx = jnp.dot(gy, fn_refs[0][:, cols], precision=_HIGHEST, preferred_element_type=_F32)
      g = gxn_ref[:, cols].astype(_F32) + dx + a2 * v + _col(co_ref, n + n * n + k) * gc
      sums = [(k, g * f), (n + n * n + k, v * gc)] + [(n + j * n + k, g * xs[j])
                                                      for j in range(n)]
      for i, prod in sums:           # gpost_k, gpre_k, gcomb[j, k]: row sums over the chunk
        gco = gco + jnp.where(col == i, jnp.sum(prod, axis=1, keepdims=True), 0.0)
      gXs = tuple(a + _col(co_ref, n + j * n + k) * g for j, a in enumerate(gXs))
      return gXs, gF + _col(co_ref, k) * g, gco

    gXs, gF, gco = jax.lax.fori_loop(0, n, stream, ((zero_tile,) * n, zero_tile, gco))
    for j in range(n):
      gX_ref[:, pl.ds(j * d + c * bd, bd)] = gXs[j].astype(gX_ref.dtype)
    gF_ref[:, pl.ds(c * bd, bd)] = gF.astype(gF_ref.dtype)
    return gco

  gco_ref[...] = jax.lax.fori_loop(0, d // bd, pass2, jnp.zeros((bt, q), _F32))


def _backward(res, cotangents, static):
  norm_eps, bt, bd, interpret, num_warps, num_stages = static
  X, F, post, comb, pre, fn, w, Xn, st = res
  gXn, gx, gst = cotangents
  *lead, n, d = X.shape
  m, s, q = _widths(n)
  tokens = int(np.prod(lead))
  gy = gst[..., :m].reshape(tokens, m).astype(_F32)
  # mean(x̂²) + eps's cotangent reaches x̂ as 2 · g / (n·d) · x̂ (jnp.mean, then the square).
  a2 = (gst[..., m].reshape(tokens, 1) / (n * d)) * 2.0
  mean_c = st[..., m + 1].reshape(tokens, 1)
  x, f, co, tokens, padded = _rows(X, F, post, comb, pre, (mean_c, a2), block_tokens=bt, q=q)
  gxn = _pad_rows(gXn.reshape(tokens, n * d).astype(X.dtype), padded)
  gx2 = _pad_rows(gx.reshape(tokens, d).astype(_F32), padded)
  gy_row = _pad_rows(jnp.pad(gy, ((0, 0), (0, s - m))), padded)
  fn_rows = _fn_terms(fn, s, X.dtype)[:2]               # [S, n·d]: f₁, f₂ (or fn in float32)
  w_row = w.astype(_F32)[None, :]
  row = lambda width: pl.BlockSpec((bt, width), lambda i: (i, 0))  # noqa: E731
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0, 0))  # noqa: E731
  blocks = padded // bt
  gX, gF, gco, gw = pl.pallas_call(
      functools.partial(_bwd_kernel, n=n, d=d, bd=bd),
      out_shape=(jax.ShapeDtypeStruct((padded, n * d), X.dtype),
                 jax.ShapeDtypeStruct((padded, d), F.dtype),
                 jax.ShapeDtypeStruct((padded, q), _F32),
                 jax.ShapeDtypeStruct((blocks, d), _F32)),
      grid=(blocks,),
      in_specs=[row(n * d), row(d), row(n * d), row(d), row(q), row(s), whole(w_row)]
               + [whole(a) for a in fn_rows],
      out_specs=(row(n * d), row(d), row(q), pl.BlockSpec((1, d), lambda i: (i, 0))),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret,
      name="mhc_site_bwd",
  )(x, f, gxn, gx2, co, gy_row, w_row, *fn_rows)
  gco = _unpad(gco, tokens)
  # d fn = gyᵀ x̂ over the tokens, one product reading X' as stored (`_mix_bf16_bwd`'s form).
  xhat = Xn.reshape(tokens, n * d)
  if X.dtype == jnp.bfloat16:
    d3 = jax.lax.dot_general(jnp.concatenate(_bf16_terms(gy, 3), -1), xhat,
                             (((0,), (0,)), ((), ())), preferred_element_type=_F32)
    gfn = d3[:m] + d3[m:2 * m] + d3[2 * m:]
  else:
    gfn = jnp.einsum("tm,tk->mk", gy, xhat.astype(_F32), precision=_HIGHEST)
  return (_unpad(gX, tokens).reshape(X.shape), _unpad(gF, tokens).reshape(F.shape),
          gco[:, :n].reshape(post.shape).astype(post.dtype),
          gco[:, n:n + n * n].reshape(comb.shape).astype(comb.dtype),
          gco[:, n + n * n:2 * n + n * n].reshape(pre.shape).astype(pre.dtype),
          gfn.astype(fn.dtype), jnp.sum(gw, axis=0).astype(w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _site_core(X, F, post, comb, pre, fn, w, static):
  """(X', x, stats [.., m + 1]: the mix y and mean(x̂²) + eps) from the forward kernel."""
  return _site_core_fwd(X, F, post, comb, pre, fn, w, static)[0]


def _site_core_fwd(X, F, post, comb, pre, fn, w, static):
  Xn, x, st = _forward(X, F, post, comb, pre, fn, w, static)
  m = (2 + X.shape[-2]) * X.shape[-2]
  return (Xn, x, st[..., :m + 1]), (X, F, post, comb, pre, fn, w, Xn, st)


def _site_core_bwd(static, res, g):
  return _backward(res, g, static)


_site_core.defvjp(_site_core_fwd, _site_core_bwd)


def hc_site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
            norm_weight, *, iters: int, hc_eps: float, norm_eps: float, block_tokens: int = 64,
            block_d: int = 32, gate_block_tokens: int = 16, num_warps: int = 8,
            num_stages: int = 2, interpret: bool | None = None):
  """The fused kernel of the op `hc_site`: (X', x, pre', post', comb') of one single-pass site.

  Both kernels take `block_tokens` × `block_d` tiles (powers of two, at least 16: the dots'
  smallest dimension) with `num_warps` warps and `num_stages` pipeline stages (module doc)."""
  *_, n, d = X_BxTxNxD.shape
  m = (2 + n) * n
  interpret = _interpret(interpret)
  bd = min(block_d, d & -d)
  for name, v in (("block_tokens", block_tokens), ("block_d", bd)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"hc_site (fused): {name} {v} is not a power of two of at least 16")
  static = (norm_eps, block_tokens, bd, interpret, num_warps, num_stages)
  Xn, x, st = _site_core(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn,
                         norm_weight, static)
  # Named like the op's mix and mean square (`ops.mhc.MIX`), and the gate rows like the
  # composition's (`pallas_kernels.mhc.hc_coefficients`): layer remat keeps them.
  st = checkpoint_name(st, MIX)
  mix = st[..., :m] * jax.lax.rsqrt(st[..., m:])
  return (Xn, x, *coefficients_of_mix(mix, base, scale, n=n, iters=iters, hc_eps=hc_eps,
                                      block_tokens=gate_block_tokens, interpret=interpret))


def unsupported_reason(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, *_,
                       block_d: int = 32, **__) -> str | None:
  """Why the kernels cannot take these arguments here (None if they can): d needs a power-of-two
  chunk of at least 16 (the dots' smallest dimension), and compiled for the GPU n must be a power
  of two (the gates kernel's rows; interpreted on the CPU, any n runs)."""
  *_, n, d = X_BxTxNxD.shape
  if X_BxTxNxD.dtype not in (jnp.float32, jnp.bfloat16):
    return f"streams of dtype {X_BxTxNxD.dtype} (float32 or bfloat16 only)"
  if fn.shape != ((2 + n) * n, n * d):
    return f"fn has shape {fn.shape}, expected {((2 + n) * n, n * d)}"
  if min(block_d, d & -d) < 16:
    return f"hidden size {d} has no power-of-two chunk of at least 16 for the site kernels"
  return gates_unsupported(X_BxTxNxD)
