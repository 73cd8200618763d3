"""The mHC site as wide streaming Triton kernels (docs/design.md §3.2–3.3, §T5; issue 27).

A kernel of the op `hc_site` (`pallas_kernels.ops.mhc.hc_site`, whose docstring has the
equations; tests/pallas_kernels/test_mhc_stream.py compares them). Not in the dispatcher's row:
`benchmarks/mhc_moe_gpu.py --only=site` times it as "stream" against the registered kernel.

Every kernel is one program per (token block, d-slice): bt tokens × bd channels of all n streams
(16 × 128 by default, 8,192 programs at s3), no loop over d. What needs a whole row (RMS
factors, the mix, the coefficients' row sums) leaves as per-slice partial rows [tokens, slices,
width] that XLA sums (a few [tokens, ≤ 32] arrays). Per token, with X [n, d] the streams, F [d]
the sublayer output, (post, comb, pre) the previous site's coefficients, w the norm weight,
ε = norm_eps:

  X'_k = post_k F + Σ_j comb[j, k] X_j   float32 (`_expand_f32`'s order), stored in X's dtype
  v_k  = X'_k as stored, in float32
  y    = Σ_k pre_k v_k                   collapse (float32), the op's order
  raw  = Σ_{k,d} v_k fn[:, k, d]         [m = (2+n)n];  ms = Σ v²/(n d) + ε,  ρ = rsqrt(ms)
  r    = rsqrt(Σ y²/d + ε),  x = (y r) w
  mix  = raw ρ  ->  (pre', post', comb') by `pallas_kernels.mhc.coefficients_of_mix` (the gates)

Forward: `_fwd_kernel` reads X and F, writes X' and y, and a partial row of (raw | Σ v² | Σ y²)
per slice; raw by tensor-core dots (bfloat16 streams: fn as three exact bfloat16 terms, the op's
`_mix_bf16`, so exact products in float32 sums; float32 streams: one IEEE float32 dot). XLA then
sums the slices, and x = (y r) w is one elementwise pass (y's round trip, 8·d bytes, costs what a
third kernel reading X' and writing x would).

Backward (by hand; cotangents gX' (X's dtype), gx, and g_raw, g_ms, which autodiff of the XLA
between the kernel and the gates gives, the gates' backward kernel included). With u = gx w:

  s1 = Σ_d u y,  h_k = Σ_d u v_k,  q_k = Σ_d y v_k       (`_h_kernel`: one pass over X' and gx)
  k_c = 2 (s1 (−r/2) / (Σy²/d + ε)) / d                  rsqrt's and the mean square's VJP
  gy  = u r + k_c y,   gpre_k = Σ_d gy v_k = r h_k + k_c q_k,   gw = Σ_tokens gx (y r)
  gv_k = gX'_k + pre_k gy + (g_raw · fn)_k + c v_k,   c = 2 g_ms / (n d)
  gX_j = Σ_k comb[j, k] gv_k,   gF = Σ_k post_k gv_k
  gpost_k = Σ_d F gv_k,   gcomb[j, k] = Σ_d X_j gv_k
  gfn  = g_rawᵀ x̂ over the tokens (one XLA product reading X'; bfloat16: `_mix_bf16_bwd`'s terms)

`_bwd_kernel` (the main pass) rebuilds X' from X and F in registers (the forward's code, so the
same values) instead of reading it: it needs X and F for gcomb and gpost anyway. gv is summed in
float32 and rounded once into gX (the op's autodiff sums the cotangents of a bfloat16 X' in
bfloat16, so with bfloat16 streams the two differ by about a bfloat16 ulp of gv); g_raw · fn is
16 bits (g₁f₁ + g₁f₂ + g₂f₁, the op's form) for bfloat16 streams and IEEE float32 otherwise.

Bytes a token (s3: bfloat16 X, X', gX', gX, F, gF; float32 y, x, gx; n = 4 so n·d·2 = 8·d):
forward X 8d + F 2d read, X' 8d + y 4d written, y 4d read + x 4d written: 30·d (the minimum,
22·d, has no y); backward `_h_kernel` X' 8d + gx 4d, `_bwd_kernel` X 8d + F 2d + gX' 8d + gx 4d
read and gX 8d + gF 2d written, the gfn product X' 8d: 52·d (minimum 40·d). On top, the
partial rows, written and read once: (S + H + P)·4 = 320 bytes a token and slice at n = 4, so
5·d at 128-channel slices, 2.5·d at 256 (`_widths`), and the per-block rows of d norm_weight,
4·d/bt bytes. fn's slices (three bfloat16 terms, [n, bd, 32] each: 96 kB a program at 128
channels) come from L2 once a program, so larger token blocks read fewer of them.

Tiles: `block_tokens` × `block_d` (powers of two ≥ 16: the dots' smallest dimension), `num_warps`,
`num_stages`; keyword arguments of `hc_site`, swept by `benchmarks/mhc_moe_gpu.py
--stream-variants`. Token counts the blocks do not tile are padded (logged once); d must be a
multiple of the slice (`unsupported_reason`); compiled for the GPU n must be a power of two (the
gate rows). `interpret=None` interprets on the CPU and compiles with Triton on the GPU.
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


def _widths(n: int) -> dict[str, int]:
  """Row widths (powers of two): S the forward partial row (raw m | Σv² | Σy², at least 16: the
  mix dot's N) and the padded fn / g_raw width; Q the coefficient row (post n | comb n² | pre n |
  r, k_c, c); H the h row (h n | q n | s1); P the backward partial row (gpost n | gcomb n²)."""
  m = (2 + n) * n
  return dict(m=m, S=max(16, _next_pow2(m + 2)), Q=_next_pow2(2 * n + n * n + 3),
              H=_next_pow2(2 * n + 1), P=_next_pow2(n + n * n))


def _col(ref, i):
  """[bt, 1] column i of a row block."""
  return ref[:, pl.ds(i, 1)]


def _post(co, k):
  return _col(co, k)


def _comb(co, j, k, n):
  return _col(co, n + j * n + k)


def _pre(co, k, n):
  return _col(co, n + n * n + k)


def _expand_tile(co_ref, f, xs, k, n, dt):
  """X'_k of a tile as stored: post_k F + Σ_j comb[j, k] X_j in `_expand_f32`'s order."""
  out = _post(co_ref, k) * f
  for j in range(n):
    out = out + _comb(co_ref, j, k, n) * xs[j]
  return out.astype(dt)


def _collapse_tile(co_ref, vs, n):
  y = _pre(co_ref, 0, n) * vs[0]
  for k in range(1, n):
    y = y + _pre(co_ref, k, n) * vs[k]
  return y


def _put(row, col, i, value):
  """row with `value` [bt, 1] added at column i (the other columns unchanged)."""
  return row + jnp.where(col == i, value, 0.0)


def _rowsum(a):
  return jnp.sum(a, axis=1, keepdims=True)


# --- forward -----------------------------------------------------------------------------------

def _fwd_kernel(x_ref, f_ref, co_ref, *refs, n: int, m: int):
  *fn_refs, xo_ref, y_ref, st_ref = refs
  bt, s = st_ref.shape
  dt = xo_ref.dtype
  f = f_ref[...].astype(_F32)
  xs = [x_ref[:, j, :].astype(_F32) for j in range(n)]
  accs = [jnp.zeros((bt, s), _F32) for _ in fn_refs]
  ssx, y = jnp.zeros((bt, 1), _F32), None
  for k in range(n):
    new = _expand_tile(co_ref, f, xs, k, n, dt)
    xo_ref[:, k, :] = new
    v = new.astype(_F32)
    ssx = ssx + _rowsum(v * v)
    y = _pre(co_ref, k, n) * v if k == 0 else y + _pre(co_ref, k, n) * v   # the collapse
    if dt == jnp.bfloat16:     # three exact bfloat16 terms of fn: exact products, float32 sums
      accs = [a + jnp.dot(new, ref[k], preferred_element_type=_F32)
              for a, ref in zip(accs, fn_refs)]
    else:
      accs = [accs[0] + jnp.dot(v, fn_refs[0][k], precision=_HIGHEST, preferred_element_type=_F32)]
  y_ref[...] = y
  raw = accs[0]
  for a in accs[1:]:           # (y₁ + y₂) + y₃, the op's order
    raw = raw + a
  col = jax.lax.broadcasted_iota(jnp.int32, (bt, s), 1)
  st_ref[...] = _put(_put(raw, col, m, ssx), col, m + 1, _rowsum(y * y))


# --- backward ----------------------------------------------------------------------------------

def _h_kernel(xn_ref, gx_ref, co_ref, w_ref, hp_ref, gw_ref, *, n: int):
  bt, h = hp_ref.shape
  vs = [xn_ref[:, k, :].astype(_F32) for k in range(n)]
  y = _collapse_tile(co_ref, vs, n)
  gx = gx_ref[...]
  u = gx * w_ref[...]
  r = _col(co_ref, 2 * n + n * n)
  col = jax.lax.broadcasted_iota(jnp.int32, (bt, h), 1)
  row = jnp.zeros((bt, h), _F32)
  for k in range(n):
    row = _put(_put(row, col, k, _rowsum(u * vs[k])), col, n + k, _rowsum(y * vs[k]))
  hp_ref[...] = _put(row, col, 2 * n, _rowsum(u * y))
  gw_ref[...] = jnp.sum(gx * (y * r), axis=0, keepdims=True)


def _bwd_kernel(x_ref, f_ref, gxn_ref, gx_ref, co_ref, graw_ref, w_ref, *refs, n: int):
  *fn_refs, gX_ref, gF_ref, gp_ref = refs
  bt, p = gp_ref.shape
  dt = x_ref.dtype
  f = f_ref[...].astype(_F32)
  xs = [x_ref[:, j, :].astype(_F32) for j in range(n)]
  # X' is rebuilt twice (for y, then stream by stream) rather than held: n fewer live tiles.
  y = _collapse_tile(co_ref, [_expand_tile(co_ref, f, xs, k, n, dt).astype(_F32)
                              for k in range(n)], n)
  base = 2 * n + n * n
  r, k_c, c = _col(co_ref, base), _col(co_ref, base + 1), _col(co_ref, base + 2)
  gy = (gx_ref[...] * w_ref[...]) * r + k_c * y
  graw = graw_ref[...]
  if dt == jnp.bfloat16:
    g1, g2 = _bf16_terms(graw, 2)
  col = jax.lax.broadcasted_iota(jnp.int32, (bt, p), 1)
  row = jnp.zeros((bt, p), _F32)
  gXs, gF = [None] * n, None
  for k in range(n):
    if dt == jnp.bfloat16:
      f1, f2 = fn_refs[0][k], fn_refs[1][k]
      dot = functools.partial(jnp.dot, preferred_element_type=_F32)
      dx = dot(g1, f1) + dot(g1, f2) + dot(g2, f1)
    else:
      dx = jnp.dot(graw, fn_refs[0][k], precision=_HIGHEST, preferred_element_type=_F32)
    v = _expand_tile(co_ref, f, xs, k, n, dt).astype(_F32)
    g = gxn_ref[:, k, :].astype(_F32) + _pre(co_ref, k, n) * gy + dx + c * v
    row = _put(row, col, k, _rowsum(g * f))
    for j in range(n):
      row = _put(row, col, n + j * n + k, _rowsum(g * xs[j]))
      term = _comb(co_ref, j, k, n) * g
      gXs[j] = term if k == 0 else gXs[j] + term
    gF = _post(co_ref, k) * g if k == 0 else gF + _post(co_ref, k) * g
  for j in range(n):
    gX_ref[:, j, :] = gXs[j].astype(gX_ref.dtype)
  gF_ref[...] = gF.astype(gF_ref.dtype)
  gp_ref[...] = row


# --- the calls ---------------------------------------------------------------------------------

def _pad(a, padded, value=0.0):
  return a if a.shape[0] == padded else jnp.pad(
      a, ((0, padded - a.shape[0]),) + ((0, 0),) * (a.ndim - 1), constant_values=value)


def _call(kernel, name, args, in_specs, out_shape, out_specs, grid, static):
  _, _, _, interpret, num_warps, num_stages = static
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret, name=name)(*args)


def _specs(bt, bd, n):
  """BlockSpecs of the (token block i, slice j) grid: streams [tokens, n, d], rows [tokens, d],
  a per-token row of width q, a slice row of width q ([tokens, slices·q]), fn [n, a, d|S]."""
  return dict(
      streams=pl.BlockSpec((bt, n, bd), lambda i, j: (i, 0, j)),
      chan=pl.BlockSpec((bt, bd), lambda i, j: (i, j)),
      w=pl.BlockSpec((1, bd), lambda i, j: (0, j)),
      row=lambda q: pl.BlockSpec((bt, q), lambda i, j: (i, 0)),
      part=lambda q: pl.BlockSpec((bt, q), lambda i, j: (i, j)),
      fn_dS=lambda s: pl.BlockSpec((n, bd, s), lambda i, j: (0, j, 0)),
      fn_Sd=lambda s: pl.BlockSpec((n, s, bd), lambda i, j: (0, 0, j)))


def _coefficient_rows(post, comb, pre, extra, tokens, q):
  co = jnp.concatenate([post.reshape(tokens, -1), comb.reshape(tokens, -1),
                        pre.reshape(tokens, -1), *extra], axis=1).astype(_F32)
  return jnp.pad(co, ((0, 0), (0, q - co.shape[1])))


def _fn_terms(fn, n, d, s, dt):
  """fn [m, n·d] as [n, S, d] float32 rows padded to S: three exact bfloat16 terms (bfloat16
  streams) or fn itself."""
  f = jnp.pad(fn.astype(_F32), ((0, s - fn.shape[0]), (0, 0))).reshape(s, n, d).transpose(1, 0, 2)
  return _bf16_terms(f, 3) if dt == jnp.bfloat16 else [f]


def _forward(X, F, post, comb, pre, fn, static):
  _, bt, bd, *_ = static
  *lead, n, d = X.shape
  wd = _widths(n)
  s, tokens = wd["S"], int(np.prod(lead))
  padded = _tokens_tiled(tokens, bt, "hc_site (stream)")
  slices = d // bd
  co = _pad(_coefficient_rows(post, comb, pre, (), tokens, wd["Q"]), padded)
  x = _pad(X.reshape(tokens, n, d), padded)
  f = _pad(F.reshape(tokens, d), padded)
  fn_dS = [t.transpose(0, 2, 1) for t in _fn_terms(fn, n, d, s, X.dtype)]   # [n, d, S]
  sp = _specs(bt, bd, n)
  Xn, y, st = _call(
      functools.partial(_fwd_kernel, n=n, m=wd["m"]), "mhc_stream_fwd", (x, f, co, *fn_dS),
      [sp["streams"], sp["chan"], sp["row"](wd["Q"])] + [sp["fn_dS"](s)] * len(fn_dS),
      (jax.ShapeDtypeStruct((padded, n, d), X.dtype), jax.ShapeDtypeStruct((padded, d), _F32),
       jax.ShapeDtypeStruct((padded, slices * s), _F32)),
      (sp["streams"], sp["chan"], sp["part"](s)), (padded // bt, slices), static)
  st = st[:tokens].reshape(tokens, slices, s).sum(axis=1)
  return Xn[:tokens].reshape(X.shape), y[:tokens], st


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _site_core(X, F, post, comb, pre, fn, w, static):
  """(X', x [tokens, d], raw [tokens, m], ms [tokens, 1]): the kernels' part of the site."""
  return _site_core_fwd(X, F, post, comb, pre, fn, w, static)[0]


def _site_core_fwd(X, F, post, comb, pre, fn, w, static):
  norm_eps = static[0]
  *_, n, d = X.shape
  m = (2 + n) * n
  Xn, y, st = _forward(X, F, post, comb, pre, fn, static)
  ms = st[:, m:m + 1] / (n * d) + norm_eps
  ms_y = st[:, m + 1:m + 2] / d + norm_eps
  r = jax.lax.rsqrt(ms_y)
  x = (y * r) * w.astype(_F32)
  return (Xn, x, st[:, :m], ms), (X, F, post, comb, pre, fn, w, Xn, r, ms_y)


def _site_core_bwd(static, res, cotangents):
  _, bt, bd, *_ = static
  X, F, post, comb, pre, fn, w, Xn, r, ms_y = res
  gXn, gx, g_raw, g_ms = cotangents
  *lead, n, d = X.shape
  wd = _widths(n)
  m, s = wd["m"], wd["S"]
  tokens = int(np.prod(lead))
  padded = _tokens_tiled(tokens, bt, "hc_site (stream)")
  slices, blocks = d // bd, padded // bt
  sp = _specs(bt, bd, n)
  w_row = w.astype(_F32).reshape(1, d)
  gx2 = _pad(gx.astype(_F32).reshape(tokens, d), padded)
  co = _coefficient_rows(post, comb, pre, (r,), tokens, wd["Q"])

  hp, gw = _call(
      functools.partial(_h_kernel, n=n), "mhc_stream_h",
      (_pad(Xn.reshape(tokens, n, d), padded), gx2, _pad(co, padded), w_row),
      [sp["streams"], sp["chan"], sp["row"](wd["Q"]), sp["w"]],
      (jax.ShapeDtypeStruct((padded, slices * wd["H"]), _F32),
       jax.ShapeDtypeStruct((blocks, d), _F32)),
      (sp["part"](wd["H"]), pl.BlockSpec((1, bd), lambda i, j: (i, j))), (blocks, slices), static)
  hp = hp[:tokens].reshape(tokens, slices, wd["H"]).sum(axis=1)
  h, q, s1 = hp[:, :n], hp[:, n:2 * n], hp[:, 2 * n:2 * n + 1]
  k_c = (s1 * (-0.5 * r / ms_y)) / d * 2.0   # rsqrt's VJP as autodiff writes it, then mean(y²)'s
  gpre = r * h + k_c * q
  c = (g_ms.astype(_F32).reshape(tokens, 1) / (n * d)) * 2.0
  co = co + jnp.pad(jnp.concatenate([k_c, c], axis=1),
                    ((0, 0), (2 * n + n * n + 1, wd["Q"] - 2 * n - n * n - 3)))
  g_raw = g_raw.astype(_F32).reshape(tokens, m)
  fn_Sd = _fn_terms(fn, n, d, s, X.dtype)[:2 if X.dtype == jnp.bfloat16 else 1]
  gX, gF, gp = _call(
      functools.partial(_bwd_kernel, n=n), "mhc_stream_bwd",
      (_pad(X.reshape(tokens, n, d), padded), _pad(F.reshape(tokens, d), padded),
       _pad(gXn.astype(X.dtype).reshape(tokens, n, d), padded), gx2, _pad(co, padded),
       _pad(jnp.pad(g_raw, ((0, 0), (0, s - m))), padded), w_row, *fn_Sd),
      [sp["streams"], sp["chan"], sp["streams"], sp["chan"], sp["row"](wd["Q"]), sp["row"](s),
       sp["w"]] + [sp["fn_Sd"](s)] * len(fn_Sd),
      (jax.ShapeDtypeStruct((padded, n, d), X.dtype), jax.ShapeDtypeStruct((padded, d), F.dtype),
       jax.ShapeDtypeStruct((padded, slices * wd["P"]), _F32)),
      (sp["streams"], sp["chan"], sp["part"](wd["P"])), (blocks, slices), static)
  gp = gp[:tokens].reshape(tokens, slices, wd["P"]).sum(axis=1)
  # d fn = g_rawᵀ x̂ over the tokens, one product reading X' as stored (`_mix_bf16_bwd`'s form).
  xhat = Xn.reshape(tokens, n * d)
  if X.dtype == jnp.bfloat16:
    d3 = jax.lax.dot_general(jnp.concatenate(_bf16_terms(g_raw, 3), -1), xhat,
                             (((0,), (0,)), ((), ())), preferred_element_type=_F32)
    gfn = d3[:m] + d3[m:2 * m] + d3[2 * m:]
  else:
    gfn = jnp.einsum("tm,tk->mk", g_raw, xhat.astype(_F32), precision=_HIGHEST)
  return (gX[:tokens].reshape(X.shape), gF[:tokens].reshape(F.shape),
          gp[:, :n].reshape(post.shape).astype(post.dtype),
          gp[:, n:n + n * n].reshape(comb.shape).astype(comb.dtype),
          gpre.reshape(pre.shape).astype(pre.dtype), gfn.astype(fn.dtype),
          jnp.sum(gw, axis=0).astype(w.dtype))


_site_core.defvjp(_site_core_fwd, _site_core_bwd)


def hc_site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
            norm_weight, *, iters: int, hc_eps: float, norm_eps: float, block_tokens: int = 16,
            block_d: int = 128, num_warps: int = 4, num_stages: int = 1,
            gate_block_tokens: int = 16, interpret: bool | None = None):
  """The streaming kernel of the op `hc_site`: (X', x, pre', post', comb') of one single-pass
  site (module doc), over `block_tokens` × `block_d` tiles."""
  *lead, n, d = X_BxTxNxD.shape
  reason = unsupported_reason(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn,
                              block_tokens=block_tokens, block_d=block_d)
  if reason:
    raise ValueError(f"hc_site (stream): {reason}")
  static = (norm_eps, block_tokens, min(block_d, d), _interpret(interpret), num_warps, num_stages)
  pre = jnp.broadcast_to(pre_BxTxN, (*lead, n))
  Xn, x, raw, ms = _site_core(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre, fn,
                              norm_weight, static)
  # Named like the op's mix and mean square (`ops.mhc.MIX`): layer remat keeps them.
  raw, ms = checkpoint_name((raw, ms), MIX)
  mix = (raw * jax.lax.rsqrt(ms)).reshape(*lead, (2 + n) * n)
  return (Xn, x.reshape(F_BxTxD.shape), *coefficients_of_mix(
      mix, base, scale, n=n, iters=iters, hc_eps=hc_eps, block_tokens=gate_block_tokens,
      interpret=interpret))


def unsupported_reason(X_BxTxNxD, F_BxTxD=None, post_BxTxN=None, comb_BxTxNxN=None,
                       pre_BxTxN=None, fn=None, *_, block_tokens: int = 16, block_d: int = 128,
                       **__) -> str | None:
  """Why the kernels cannot take these arguments (None if they can): float32 or bfloat16 streams,
  tiles of powers of two ≥ 16 (the dots' smallest dimension), d a multiple of the slice
  min(block_d, d), and compiled for the GPU n a power of two (the gate rows)."""
  *_, n, d = X_BxTxNxD.shape
  bd = min(block_d, d)
  if X_BxTxNxD.dtype not in (jnp.float32, jnp.bfloat16):
    return f"streams of dtype {X_BxTxNxD.dtype} (float32 or bfloat16 only)"
  if fn is not None and fn.shape != ((2 + n) * n, n * d):
    return f"fn has shape {fn.shape}, expected {((2 + n) * n, n * d)}"
  for name, v in (("block_tokens", block_tokens), ("slice min(block_d, d)", bd)):
    if v < 16 or v & (v - 1):
      return f"{name} {v} is not a power of two of at least 16"
  if d % bd:
    return f"hidden size {d} is not a multiple of the slice {bd}"
  return gates_unsupported(X_BxTxNxD)
