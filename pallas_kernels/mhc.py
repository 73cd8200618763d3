"""Fused mHC coefficients + Sinkhorn projection (docs/design.md §3.2; §T5).

Why this fusion: under V4.1's single-pass schedule (§3.3) a site's collapse uses the PREVIOUS
site's `pre`, so coefficients and collapse do not meet in one pass; the expensive part of a site is
reading X once for the RMS and the (2+n)n-column mix, and the cheap but launch-heavy part is the
19 Sinkhorn alternations on tiny n×n matrices. One kernel does both (DeepSeek's `hc_pre` +
`hc_split_sinkhorn`): each program takes `block_tokens` tokens, streams their n·d values in chunks
of `block_k` (sum of squares and x̂·fnᵀ accumulated in float32), then applies the RMS factor,
sigmoids and the Sinkhorn loop in registers, and writes one [tokens, P] row per token.

Layout of that row (P = R·n with R = next power of two ≥ 2+n; the wrapper pads fn/base with zeros):
group 0 = pre, group 1 = post, groups 2 … n+1 = comb rows j (comb[j, k] at column (2+j)·n + k),
further groups are padding. The wrapper splits it into (pre [.., n], post [.., n], comb [.., n, n]).

The kernel restates the op `pallas_kernels.ops.mhc.hc_coefficients` (tests compare the two); its
custom VJP is the op's own VJP.
Backend: Triton via `pl.pallas_call` with explicit `CompilerParams` (power-of-two blocks). The mix
is an IEEE-float32 `dot` for float32 streams and three bfloat16 tensor-core dots against fn split
into hi + mid + lo (`split_bf16x3`) for bfloat16 streams; `interpret=True` runs it on CPU.
Measured on the H200 (benchmarks/RESULTS.md): 2.5–3.1× the XLA reference for bfloat16 streams,
outputs within 2.6e-4 of XLA's float32 path (the tensor cores' float32 accumulation over n·d
terms); the IEEE float32 dot is within 1.3e-5 but runs on the FMA path, 8× slower than XLA.
Under a multi-device mesh the dispatcher runs it per batch shard (`pallas_kernels.dispatch`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.ops import mhc as ops_mhc

_HIGHEST = jax.lax.Precision.HIGHEST


def _triton_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(v: int) -> int:
  return 1 << (v - 1).bit_length()


def _coefficient_rows(acc, ss, scale_row, base_row, *, n: int, groups: int, k_total: int,
                      iters: int, hc_eps: float, norm_eps: float):
  """[bt, P] rows (pre | post | comb rows | padding) from the raw mix acc = x̂·fnᵀ and Σx̂²."""
  rho = jax.lax.rsqrt(ss / k_total + norm_eps)
  z = (acc * rho) * scale_row + base_row                     # [bt, P]
  return gate_rows(z, n=n, groups=groups, iters=iters, hc_eps=hc_eps)


def gate_rows(z, *, n: int, groups: int, iters: int, hc_eps: float):
  """[bt, P] rows (pre | post | comb rows | padding) from the gate logits z [bt, P] (same layout):
  sigmoids and the Sinkhorn projection in registers (a kernel body's code)."""
  bt = z.shape[0]
  z3 = z.reshape(bt, groups, n)
  group = jax.lax.broadcasted_iota(jnp.int32, (bt, groups, n), 1)
  is_comb = (group >= 2) & (group < 2 + n)

  sig = 1.0 / (1.0 + jnp.exp(-z3))
  e = jnp.exp(z3 - jnp.max(z3, axis=2, keepdims=True))
  comb = e / jnp.sum(e, axis=2, keepdims=True) + hc_eps      # row softmax (every group; masked below)
  comb = jnp.where(is_comb, comb, 0.0)
  comb = _col_norm(comb, hc_eps)
  # Padding groups stay 0 (0 / (0 + eps)). A loop, not unrolled: the body is tiny and compiles once.
  comb = jax.lax.fori_loop(0, iters - 1,
                           lambda _, c: _col_norm(_row_norm(c, hc_eps), hc_eps), comb)
  out = jnp.where(group == 0, sig + hc_eps, jnp.where(group == 1, 2.0 * sig, comb))
  return out.reshape(bt, groups * n)


def _col_norm(c, eps):  # c [bt, groups, n]: divide each column k by (Σ_j c[j, k] + eps)
  return c / (jnp.sum(c, axis=1, keepdims=True) + eps)


def _row_norm(c, eps):
  return c / (jnp.sum(c, axis=2, keepdims=True) + eps)


def _mhc_kernel(x_ref, *refs, n: int, groups: int, k_total: int, block_k: int, iters: int,
                hc_eps: float, norm_eps: float):
  *f_refs, scale_ref, base_ref, o_ref = refs
  bt = x_ref.shape[0]
  p = groups * n

  def chunk(c, carry):
    acc, ss = carry
    xc = x_ref[:, pl.ds(c * block_k, block_k)]                      # [bt, block_k]
    x32 = xc.astype(jnp.float32)
    for f_ref in f_refs:  # one float32 fn, or its three bfloat16 pieces for bfloat16 streams
      fc = f_ref[pl.ds(c * block_k, block_k), :]                    # [block_k, P]
      lhs = xc if fc.dtype == xc.dtype else x32
      acc = acc + jnp.dot(lhs, fc, precision=_HIGHEST, preferred_element_type=jnp.float32)
    ss = ss + jnp.sum(x32 * x32, axis=1, keepdims=True)
    return acc, ss

  acc, ss = jax.lax.fori_loop(0, k_total // block_k, chunk,
                              (jnp.zeros((bt, p), jnp.float32), jnp.zeros((bt, 1), jnp.float32)))
  o_ref[...] = _coefficient_rows(acc, ss, scale_ref[...], base_ref[...], n=n, groups=groups,
                                 k_total=k_total, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)


def split_bf16x3(f: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """float32 f as hi + mid + lo, three bfloat16 arrays (8 significant bits each, 24 in all).

  A bfloat16 x times each piece is exact in float32, so x·hi + x·mid + x·lo with float32
  accumulation is the float32 product x·f on the bfloat16 tensor cores (the model's streams are
  bfloat16; Triton's IEEE float32 dot runs on the slow FMA path). The pieces are cut from the bits
  (truncation, exact), not by `f - f.astype(bf16).astype(f32)`: XLA on GPU folds that round trip.
  """
  def head(v):  # the top 8 significant bits, by truncation: exact in bfloat16
    bits = jax.lax.bitcast_convert_type(v, jnp.int32) & np.int32(-65536)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
  hi = head(f)
  r1 = f - hi
  mid = head(r1)
  lo = r1 - mid
  return hi.astype(jnp.bfloat16), mid.astype(jnp.bfloat16), lo.astype(jnp.bfloat16)


def param_rows(fn, base, scale, n: int, stream_dtype):
  """fn as [n·d, P] (float32, or its three bfloat16 pieces for bfloat16 streams), and the
  [1, P] rows of per-column scale and base, P = next_pow2(2+n)·n (zero padding columns)."""
  p = _next_pow2(2 + n) * n
  f_kxp = jnp.pad(fn.astype(jnp.float32).T, ((0, 0), (0, p - fn.shape[0])))
  f_parts = split_bf16x3(f_kxp) if stream_dtype == jnp.bfloat16 else (f_kxp,)
  scale = scale.astype(jnp.float32)
  scale_row = jnp.concatenate([jnp.full((n,), scale[0]), jnp.full((n,), scale[1]),
                               jnp.full((p - 2 * n,), scale[2])])[None, :]
  base_row = jnp.pad(base.astype(jnp.float32), (0, p - base.shape[0]))[None, :]
  return f_parts, scale_row, base_row


@functools.partial(jax.jit, static_argnames=("iters", "hc_eps", "norm_eps", "block_tokens",
                                             "block_k", "interpret", "num_warps", "num_stages"))
def hc_coefficients_pallas(X_BxTxNxD, fn, base, scale, *, iters: int, hc_eps: float,
                           norm_eps: float, block_tokens: int = 64, block_k: int = 64,
                           interpret: bool = False, num_warps: int = 4, num_stages: int = 3):
  """(pre, post, comb) of one mHC site from the fused kernel; float32, shapes as the reference."""
  *lead, n, d = X_BxTxNxD.shape
  k_total = n * d
  if (2 + n) * n != fn.shape[0] or fn.shape[1] != k_total:
    raise ValueError(f"fn has shape {fn.shape}, expected {((2 + n) * n, k_total)}")
  block_k = min(block_k, k_total & -k_total)  # largest power of two dividing n·d, capped
  groups = _next_pow2(2 + n)
  p = groups * n
  tokens = int(np.prod(lead)) if lead else 1
  x = X_BxTxNxD.reshape(tokens, k_total)
  padded = pl.cdiv(tokens, block_tokens) * block_tokens
  if padded != tokens:
    x = jnp.pad(x, ((0, padded - tokens), (0, 0)))
  if X_BxTxNxD.dtype != jnp.bfloat16:
    x = x.astype(jnp.float32)
  f_parts, scale_row, base_row = param_rows(fn, base, scale, n, X_BxTxNxD.dtype)
  kernel = functools.partial(_mhc_kernel, n=n, groups=groups, k_total=k_total, block_k=block_k,
                             iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((padded, p), jnp.float32),
      grid=(padded // block_tokens,),
      in_specs=[pl.BlockSpec((block_tokens, k_total), lambda i: (i, 0))]
               + [pl.BlockSpec((k_total, p), lambda i: (0, 0))] * len(f_parts)
               + [pl.BlockSpec((1, p), lambda i: (0, 0)),
                pl.BlockSpec((1, p), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((block_tokens, p), lambda i: (i, 0)),
      compiler_params=None if interpret else _triton_params(num_warps, num_stages),
      interpret=interpret,
      name="mhc_coefficients",
  )(x, *f_parts, scale_row, base_row)
  out = out[:tokens].reshape(*lead, groups, n)
  return out[..., 0, :], out[..., 1, :], out[..., 2:2 + n, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _hc(X, fn, base, scale, iters, hc_eps, norm_eps, interpret):
  return hc_coefficients_pallas(X, fn, base, scale, iters=iters, hc_eps=hc_eps,
                                norm_eps=norm_eps, interpret=interpret)


def _hc_fwd(X, fn, base, scale, iters, hc_eps, norm_eps, interpret):
  out = hc_coefficients_pallas(X, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                               interpret=interpret)
  return out, (X, fn, base, scale)


def _hc_bwd(iters, hc_eps, norm_eps, interpret, res, g):
  del interpret
  _, vjp = jax.vjp(lambda *a: ops_mhc.hc_coefficients(*a, iters=iters, hc_eps=hc_eps,
                                                      norm_eps=norm_eps), *res)
  return vjp(g)


_hc.defvjp(_hc_fwd, _hc_bwd)


def unsupported_reason(X_BxTxNxD, fn, base, scale, **_) -> str | None:
  """Why the kernel cannot take these shapes (None if it can)."""
  *_, n, d = X_BxTxNxD.shape
  if fn.shape != ((2 + n) * n, n * d):
    return f"fn has shape {fn.shape}, expected {((2 + n) * n, n * d)}"
  if (n * d) & -(n * d) < 16:
    return f"n·d = {n * d} has no power-of-two chunk ≥ 16 (Triton blocks)"
  return None


def hc_coefficients(X_BxTxNxD, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float,
                    interpret: bool | None = None):
  """Kernel of the op `hc_coefficients`: fused forward, the op's backward.

  `interpret=None` interprets on CPU and compiles (Triton) on GPU.
  """
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return _hc(X_BxTxNxD, fn, base, scale, iters, hc_eps, norm_eps, interpret)
