"""The mHC site's stream pass as Triton kernels, forward and backward (docs/design.md §3.2–3.3; issue 27).

A kernel of the op `hc_site` (`pallas_kernels.ops.mhc.hc_site` has the equations). Per token, with
X [n, d] the streams entering the previous site, F [d] its sublayer output and (post, comb, pre)
its coefficients:

  v_k = X'_k = post_k F + Σ_j comb[j, k] X_j     float32 in `_expand_f32`'s order, stored in X's dtype
  y   = Σ_k pre_k v_k                            the collapse (of X' as stored), float32
  x   = (y · rsqrt(mean(y²) + eps)) · w          the sublayer input (`rms_norm`), float32
  ms  = mean(v²) + eps over the n·d values       the mix's RMS
  raw = v · fnᵀ [m = (2+n)n]                     the mix before its RMS factor (one XLA GEMM)

The forward kernel (`_fwd_kernel`) reads X and F once and writes X', x and the two means: a program
takes up to `FWD_TILES[0]` whole rows (d in static chunks, the rows' y kept in registers until the
norm's factor is known; `forward_tiles` halves the rows until they hold at most 16,384 float32
values, so wide hidden sizes do not spill). The mix `raw` is one GEMM over X' (`ops.mhc._mix_bf16`'s
form: bfloat16 streams through three exact bfloat16 terms of fn; float32 at HIGHEST); the gates
(sigmoids, Sinkhorn) are `pallas_kernels.mhc.gates`. The earlier kernel
(`pallas_kernels.mhc.hc_site`, the dispatcher's until session 69) runs the same math as XLA fusions
that read X' three more times (collapse, its norm, the mean square). On an H100 at s3 this forward
kernel took 0.132 ms for its 369 MB (2.8 TB/s, the card's copy rate) and the whole forward 0.260 ms
against the earlier kernel's 0.416 (benchmarks/RESULTS.md, session 68); forward + backward 0.96-1.05
ms against its 1.20-1.30 (1.21-1.36x), and the s3 step 0.6 / 1.1 % shorter in two paired runs
(session 69): the dispatcher's kernel of `hc_site` since then.

The backward kernel (`_bwd_kernel`, residuals: X, F, the coefficients, X', x and the means) is one
pass over d per token block: with the per-token scalars s = Σ_d gx · x (one XLA row sum), the
forward's r = rsqrt(mean(y²) + eps) and a = 2 g_ms / (n·d),

  gy    = (gx · w) · r − y · s / ((mean(y²) + eps) · d)          the norm's VJP
  gv_k  = gX'_k + (g_raw · fn)_k + pre_k gy + a v_k              float32 (one rounding at the end)
  gX_j  = Σ_k comb[j, k] gv_k,  gF = Σ_k post_k gv_k,  gpost_k = Σ_d gv_k F,
  gcomb[j, k] = Σ_d gv_k X_j,  gpre_k = Σ_d v_k gy,  d w = Σ_tokens gx · y · r (per-block rows)

g_raw · fn, the mix's cotangent of X', is one XLA product in X's dtype (`_mix_bf16_bwd`'s dx, 16
bits for bfloat16 streams) that the kernel reads like gX'. Inside the kernel it cost too much: as a
tensor-core dot the kernel took 255 registers and spilled at every tile tried (ptxas -v for sm_90a
through Triton 3.6 on the CPU host); as float32 FMAs on fn's rows the backward kernel took 0.92 ms
on an H100 at s3 (RESULTS.md, session 68). d fn = g_rawᵀ X' is one XLA product over the tokens
(`_mix_bf16_bwd`'s form). The other pieces of gv are summed in float32 before one rounding (the op
sums its cotangents of a bfloat16 X' in bfloat16), so the kernel's gradients are the reference's
or closer to exact.

Bytes at s3 (n = 4, d = 1024, bfloat16 streams, 16,384 tokens): forward 369 MB (X, F read; X', x
written) + 134 MB for the mix GEMM; backward 669 MB (X, F, gX', the mix's cotangent, gx read; gX, gF
written) + 134 MB written by the mix's cotangent product + 134 MB (s: gx and x) + 134 MB (d fn reads
X'). `interpret=None` interprets on the CPU and compiles with Triton on the GPU. Token counts the
blocks do not tile are padded (logged once). Triton blocks are powers of two: n, d's chunks and the
coefficient rows (`unsupported_reason`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels.mhc import (_interpret, _next_pow2, _tokens_tiled, _triton_params,
                                 coefficients_of_mix)
from pallas_kernels.ops.mhc import MIX, _mix_bf16

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST

# Tiles (tokens, channels, warps): the forward keeps a block's y [tokens, d] float32 in registers.
# Registers for sm_90a at s3's widths (ptxas -v, Triton 3.6, bfloat16 streams; none spill):
#   forward 8 × 256 × 8 148, 4 × 256 × 4 142, 4 × 512 × 4 168;
#   backward 8 × 64 × 4 128, 16 × 64 × 8 128, 32 × 64 × 8 191.
# On an H100 at s3 (session 69, bursts, the site's forward + backward), backward tiles:
#   32 × 64 × 8 0.960 / 0.997 ms in two calls, 8 × 64 × 4 1.045 / 1.024;
#   16 × 128 × 8 0.934, 32 × 32 × 8 0.945, 64 × 64 × 8 1.096 once each.
# The forward's 8 × 256 × 8 was the fastest of four (session 68).
FWD_TILES = (8, 256, 8)
BWD_TILES = (32, 64, 8)
# A forward block's y [tokens, d] float32 at most this many values (8 warps: 64 a thread). ptxas
# for the forward at 8 warps: d 1536 × 8 tokens 204 registers, d 4096 × 4 232, d 5120 × 2 220, none
# spilling; d 4096 × 8 and d 5120 × 8 spill (255 registers, ~470 B). Widths above 1024 are not yet
# timed on a GPU.
FWD_Y_VALUES = 16384


def forward_tiles(d: int, tiles: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
  """`tiles` (default `FWD_TILES`) with its token rows halved (to 1 at least) until a block's y
  holds at most `FWD_Y_VALUES` float32 values."""
  bt, bd, warps = tiles or FWD_TILES
  while bt > 1 and bt * d > FWD_Y_VALUES:
    bt //= 2
  return bt, bd, warps


def _row_width(n: int) -> int:
  """The coefficient row width: post n | comb n² | pre n, padded to a power of two."""
  return _next_pow2(2 * n + n * n)


def _col(ref, i):
  """[bt, 1] column i of a row block (a coefficient or a per-token scalar)."""
  return ref[:, pl.ds(i, 1)]


def _coefficients(co_ref, n):
  """(post [n], comb [n][n] as comb[j][k], pre [n]) as [bt, 1] columns, loaded once a program
  (before any store: loads after one are not merged)."""
  post = [_col(co_ref, k) for k in range(n)]
  comb = [[_col(co_ref, n + j * n + k) for k in range(n)] for j in range(n)]
  pre = [_col(co_ref, n + n * n + k) for k in range(n)]
  return post, comb, pre


def _streams_new(post, comb, f, xs):
  """The chunk's X'_k, float32 before rounding, in `_expand_f32`'s order."""
  out = []
  for k in range(len(post)):
    v = post[k] * f
    for j in range(len(post)):
      v = v + comb[j][k] * xs[j]
    out.append(v)
  return out


def _load_chunk(x_ref, f_ref, c0, bd, *, n, d):
  f = f_ref[:, pl.ds(c0, bd)].astype(_F32)
  return f, [x_ref[:, pl.ds(j * d + c0, bd)].astype(_F32) for j in range(n)]


# --- forward -----------------------------------------------------------------------------------

def _fwd_kernel(x_ref, f_ref, co_ref, w_ref, xo_ref, yo_ref, st_ref, *, n, d, bd, norm_eps):
  dt = xo_ref.dtype
  bt = st_ref.shape[0]
  post, comb, pre = _coefficients(co_ref, n)
  ys, ssx, ssy = [], jnp.zeros((bt, 1), _F32), jnp.zeros((bt, 1), _F32)
  for c in range(d // bd):                      # static: the rows' y stay in registers
    f, xs = _load_chunk(x_ref, f_ref, c * bd, bd, n=n, d=d)
    y = None
    for k, v in enumerate(_streams_new(post, comb, f, xs)):
      v = v.astype(dt)
      xo_ref[:, pl.ds(k * d + c * bd, bd)] = v
      v = v.astype(_F32)
      ssx = ssx + jnp.sum(v * v, axis=1, keepdims=True)
      term = pre[k] * v
      y = term if y is None else y + term       # `collapse`'s order
    ys.append(y)
    ssy = ssy + jnp.sum(y * y, axis=1, keepdims=True)
  mean_y = ssy / d + norm_eps
  r = jax.lax.rsqrt(mean_y)
  for c, y in enumerate(ys):
    yo_ref[:, pl.ds(c * bd, bd)] = (y * r) * w_ref[:, pl.ds(c * bd, bd)]
  col = jax.lax.broadcasted_iota(jnp.int32, st_ref.shape, 1)
  st_ref[...] = jnp.where(col == 0, ssx / (n * d) + norm_eps, mean_y)


# --- backward ----------------------------------------------------------------------------------

def _bwd_kernel(x_ref, f_ref, gxo_ref, gmx_ref, gx_ref, co_ref, sc_ref, w_ref, gX_ref, gF_ref,
                gco_ref, gw_ref, *, n, d, bd):
  dt = x_ref.dtype
  bt, q = gco_ref.shape
  r, kc, a = _col(sc_ref, 0), _col(sc_ref, 1), _col(sc_ref, 2)
  post, comb, pre = _coefficients(co_ref, n)
  col = jax.lax.broadcasted_iota(jnp.int32, (bt, q), 1)

  def put(acc, i, v):
    return acc + jnp.where(col == i, jnp.sum(v, axis=1, keepdims=True), 0.0)

  def chunk(c, acc):
    # acc [bt, Q]: the per-token sums over d (gpost_k at k, gcomb[j, k] at n + j·n + k, gpre_k at
    # n + n² + k), one tile rather than 2n + n² columns carried through the loop.
    c0 = c * bd
    f, xs = _load_chunk(x_ref, f_ref, c0, bd, n=n, d=d)
    vs = [v.astype(dt).astype(_F32) for v in _streams_new(post, comb, f, xs)]
    y = None
    for k in range(n):
      term = pre[k] * vs[k]
      y = term if y is None else y + term
    gxc = gx_ref[:, pl.ds(c0, bd)]
    gw_ref[:, pl.ds(c0, bd)] = jnp.sum(gxc * (y * r), axis=0, keepdims=True)
    gy = (gxc * w_ref[:, pl.ds(c0, bd)]) * r + y * kc
    gX = [None] * n
    gF = None
    for k in range(n):
      cols = pl.ds(k * d + c0, bd)
      gv = (gxo_ref[:, cols].astype(_F32) + gmx_ref[:, cols].astype(_F32) + pre[k] * gy
            + a * vs[k])
      acc = put(acc, n + n * n + k, vs[k] * gy)
      acc = put(acc, k, gv * f)
      pk = post[k] * gv
      gF = pk if gF is None else gF + pk
      for j in range(n):
        acc = put(acc, n + j * n + k, gv * xs[j])
        t = comb[j][k] * gv
        gX[j] = t if gX[j] is None else gX[j] + t
    for j in range(n):
      gX_ref[:, pl.ds(j * d + c0, bd)] = gX[j].astype(gX_ref.dtype)
    gF_ref[:, pl.ds(c0, bd)] = gF.astype(gF_ref.dtype)
    return acc

  gco_ref[...] = jax.lax.fori_loop(0, d // bd, chunk, jnp.zeros((bt, q), _F32))


# --- the op's kernel ---------------------------------------------------------------------------

def _pad_rows(a, padded):
  return a if a.shape[0] == padded else jnp.pad(a, ((0, padded - a.shape[0]), (0, 0)))


def _coefficient_rows(post, comb, pre, tokens, q):
  n = post.shape[-1]
  co = jnp.concatenate([post.reshape(tokens, n), comb.reshape(tokens, n * n),
                        pre.reshape(tokens, n)], axis=1).astype(_F32)
  return jnp.pad(co, ((0, 0), (0, q - co.shape[1])))


def _mix(Xn_rows, fn):
  """raw = X' · fnᵀ [tokens, m] float32: `ops.mhc.hc_mix`'s product before its RMS factor."""
  if Xn_rows.dtype == jnp.bfloat16:
    return _mix_bf16(Xn_rows, fn.astype(_F32))
  return jnp.einsum("...k,mk->...m", Xn_rows.astype(_F32), fn.astype(_F32), precision=_HIGHEST)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _site_rows(X, F, post, comb, pre, w, fn, static):
  """(X' [tokens, n·d], x [tokens, d] float32, raw [tokens, m], ms [tokens, 1]) of flattened rows."""
  return _site_rows_fwd(X, F, post, comb, pre, w, fn, static)[0]


def _site_rows_fwd(X, F, post, comb, pre, w, fn, static):
  n, d, norm_eps, fwd_tiles, _, interpret = static
  bt, bd, warps = fwd_tiles
  bd = min(bd, d)
  tokens = X.shape[0]
  q = _row_width(n)
  padded = _tokens_tiled(tokens, bt, "hc_site (rows)")
  co = _pad_rows(_coefficient_rows(post, comb, pre, tokens, q), padded)
  row = lambda width: pl.BlockSpec((bt, width), lambda i: (i, 0))  # noqa: E731
  w_row = w.astype(_F32).reshape(1, d)
  Xn, x, st = pl.pallas_call(
      functools.partial(_fwd_kernel, n=n, d=d, bd=bd, norm_eps=norm_eps),
      out_shape=(jax.ShapeDtypeStruct((padded, n * d), X.dtype),
                 jax.ShapeDtypeStruct((padded, d), _F32),
                 jax.ShapeDtypeStruct((padded, 2), _F32)),
      grid=(padded // bt,),
      in_specs=[row(n * d), row(d), row(q), pl.BlockSpec((1, d), lambda i: (0, 0))],
      out_specs=(row(n * d), row(d), row(2)),
      compiler_params=None if interpret else _triton_params(warps, 1),
      interpret=interpret,
      name="mhc_site_rows_fwd",
  )(_pad_rows(X, padded), _pad_rows(F, padded), co, w_row)
  Xn, x, st = Xn[:tokens], x[:tokens], st[:tokens]
  raw = _mix(Xn, fn)
  return (Xn, x, raw, st[:, :1]), (X, F, post, comb, pre, w, fn, Xn, x, st[:, 1:])


def _site_rows_bwd(static, res, g):
  n, d, _, _, bwd_tiles, interpret = static
  bt, bd, warps = bwd_tiles
  bd = min(bd, d)
  X, F, post, comb, pre, w, fn, Xn, x, mean_y = res
  gXn, gx, g_raw, g_ms = g
  tokens = X.shape[0]
  q = _row_width(n)
  padded = _tokens_tiled(tokens, bt, "hc_site (rows) backward")
  gx = gx.astype(_F32)
  s_row = jnp.sum(gx * x, axis=-1, keepdims=True)               # = r · Σ (gx · w) · y
  scalars = jnp.concatenate([jax.lax.rsqrt(mean_y), -s_row / (mean_y * d),
                             g_ms * (2.0 / (n * d)), jnp.zeros_like(mean_y)], axis=1)
  # The mix's cotangents (of X', in X's dtype, and of fn) by the product's own VJP (`_mix_bf16`'s
  # for bfloat16 streams); its forward product has no reader here and is left out.
  g_mix, dfn = jax.vjp(_mix, Xn, fn)[1](g_raw.astype(_F32))
  co = _coefficient_rows(post, comb, pre, tokens, q)
  row = lambda width: pl.BlockSpec((bt, width), lambda i: (i, 0))  # noqa: E731
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0, 0))  # noqa: E731
  w_row = w.astype(_F32).reshape(1, d)
  gX, gF, gco, gw = pl.pallas_call(
      functools.partial(_bwd_kernel, n=n, d=d, bd=bd),
      out_shape=(jax.ShapeDtypeStruct((padded, n * d), X.dtype),
                 jax.ShapeDtypeStruct((padded, d), F.dtype),
                 jax.ShapeDtypeStruct((padded, q), _F32),
                 jax.ShapeDtypeStruct((padded // bt, d), _F32)),
      grid=(padded // bt,),
      in_specs=[row(n * d), row(d), row(n * d), row(n * d), row(d), row(q), row(4), whole(w_row)],
      out_specs=(row(n * d), row(d), row(q), pl.BlockSpec((1, d), lambda i: (i, 0))),
      compiler_params=None if interpret else _triton_params(warps, 1),
      interpret=interpret,
      name="mhc_site_rows_bwd",
  )(*(_pad_rows(a, padded) for a in (X, F, gXn.astype(X.dtype), g_mix, gx, co, scalars)), w_row)
  gco = gco[:tokens]
  return (gX[:tokens], gF[:tokens], gco[:, :n].astype(post.dtype),
          gco[:, n:n + n * n].reshape(comb.shape).astype(comb.dtype),
          gco[:, n + n * n:2 * n + n * n].astype(pre.dtype),
          jnp.sum(gw, axis=0).astype(w.dtype), dfn)


_site_rows.defvjp(_site_rows_fwd, _site_rows_bwd)


def hc_site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
            norm_weight, *, iters: int, hc_eps: float, norm_eps: float, block_tokens: int = 16,
            fwd_tiles: tuple[int, int, int] | None = None,
            bwd_tiles: tuple[int, int, int] = BWD_TILES, interpret: bool | None = None):
  """Kernel of the op `hc_site`: (X', x, pre', post', comb') of one single-pass site (module doc)."""
  *lead, n, d = X_BxTxNxD.shape
  tokens = int(np.prod(lead))
  interpret = _interpret(interpret)
  fwd_tiles = forward_tiles(d) if fwd_tiles is None else tuple(fwd_tiles)
  static = (n, d, norm_eps, fwd_tiles, tuple(bwd_tiles), interpret)
  Xn, x, raw, ms = _site_rows(
      X_BxTxNxD.reshape(tokens, n * d), F_BxTxD.reshape(tokens, d),
      post_BxTxN.reshape(tokens, n), comb_BxTxNxN.reshape(tokens, n, n),
      pre_BxTxN.reshape(tokens, n), norm_weight, fn, static)
  # Named like the op's mix (`ops.mhc.MIX`): under the model's remat policy the recomputed
  # forward's GEMM then has no reader (raw is no residual of the backward) and is left out.
  mix = (checkpoint_name(raw, MIX) * jax.lax.rsqrt(checkpoint_name(ms, MIX))).reshape(
      *lead, (2 + n) * n)
  coefficients = coefficients_of_mix(mix, base, scale, n=n, iters=iters, hc_eps=hc_eps,
                                     block_tokens=block_tokens, interpret=interpret)
  return (Xn.reshape(X_BxTxNxD.shape), x.reshape(*lead, d), *coefficients)


def unsupported_reason(X_BxTxNxD, *_, fwd_tiles=None, bwd_tiles=BWD_TILES,
                       **__) -> str | None:
  """Why these kernels cannot take these streams here (None if they can): compiled for the GPU,
  Triton blocks are powers of two, so n must be one and d a multiple of both chunk widths."""
  n, d = X_BxTxNxD.shape[-2:]
  if jax.default_backend() != "gpu":
    return None
  if n & (n - 1):
    return f"hc_mult {n} is not a power of two (Triton blocks)"
  for what, (_, bd, _) in (("forward", fwd_tiles or FWD_TILES), ("backward", bwd_tiles)):
    chunk = min(bd, d)
    if d % chunk or chunk & (chunk - 1):
      return (f"hidden size {d} is not a multiple of a power-of-two chunk of at most {bd} channels "
              f"(the {what} kernel's)")
  return None
