"""Op: mHC coefficients, Sinkhorn projection, collapse, expand and the single-pass site (docs/design.md §3.2–3.3).

The hidden state is n = hc_mult residual streams X [B, T, n, d]. A site's parameters are `fn`
[(2+n)n, n·d], `base` [(2+n)n] and `scale` [3]; they turn X into three token-dependent
coefficient sets, in the exact DeepSeek form (§3.2):

  x̂    = X.reshape(B, T, n·d)                       float32
  ρ    = rsqrt(mean(x̂², -1) + rms_norm_eps)         unweighted RMS over all n·d channels
  mix  = (x̂ @ fnᵀ) · ρ                              [B, T, (2+n)n]            (`hc_mix`)
  pre  = sigmoid(mix[:n] · scale[0] + base[:n]) + hc_eps             [B, T, n]
  post = 2 · sigmoid(mix[n:2n] · scale[1] + base[n:2n])              [B, T, n]
  comb = sinkhorn_project(mix[2n:].reshape(n, n) · scale[2] + base[2n:].reshape(n, n))
                                                                     [B, T, n, n], comb[j, k]

The sublayer then reads `collapse(X, pre) = Σ_i pre_i X_i` [B, T, d] and writes
`expand(X, post, comb, F) = X'` with X'_k = post_k · F + Σ_j comb[j, k] · X_j (combᵀ X). Both are
n unrolled broadcast multiply-adds in float32 with hand-written VJPs of the same kind (row sums
over d for the coefficients' cotangents): written as einsums over the 4-wide stream axis, XLA runs
them as per-token batched 4 × 4 GEMMs (on the H200 expand measured 0.668 ms forward / 1.178 ms
forward+backward per s3 site that way against 0.366 / 0.946 ms; benchmarks/RESULTS.md, issue 27).
`hc_site` composes one single-pass site (§3.3: the previous site's expand, this site's
coefficients, collapse + sublayer norm) as one function.

`hc_coefficients` and `hc_site` are ops of the dispatcher (`pallas_kernels.dispatch`), with the
kernels of `pallas_kernels/mhc.py` (the Sinkhorn gates in Triton); the model's `MHCSite`
(`dsv41_jax/layers/mhc.py`) holds the parameters and the block (`dsv41_jax/block.py`) the wiring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.ops.norm import rms_norm

_HIGHEST = jax.lax.Precision.HIGHEST

# Remat name (`dsv41_jax.model.remat_policy` keeps it): the mix product x̂ @ fnᵀ [.., (2+n)n] and
# mean(x̂²) + eps [.., 1] of every site. The backward needs both, so without them layer remat read
# the float32 streams twice more per site, once in the float32 SGEMM (16384 × 4096 × 24 at s3:
# ~0.14 ms on the H200, 40 sites) and once for the mean square, to save 1.6 MB per site.
MIX = "hc_mix"


def sinkhorn_project(logits_NxN: jax.Array, iters: int, eps: float) -> jax.Array:
  """Near-doubly-stochastic matrix from logits [..., n, n] (DeepSeek's `hc_split_sinkhorn`).

  Row softmax + eps, a column normalisation, then (iters − 1) alternations of row and column
  normalisation, each dividing by (sum + eps). Float32 in, float32 out.
  """
  comb = jax.nn.softmax(logits_NxN, axis=-1) + eps
  comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

  def alternation(_, comb):
    comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
    return comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

  # A loop, not unrolled: a quarter of the train step's kernels were these alternations.
  return jax.lax.fori_loop(0, iters - 1, alternation, comb)


def _bf16_terms(a: jax.Array, k: int) -> list[jax.Array]:
  """k bfloat16 terms whose float32 sum is `a` (float32) to 8·k significant bits (3: all 24)."""
  terms, rest = [], a.astype(jnp.float32)
  for _ in range(k):
    terms.append(rest.astype(jnp.bfloat16))
    rest = rest - terms[-1].astype(jnp.float32)
  return terms


def _dot_f32(a, b, spec):
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _mix_bf16(x_BxK: jax.Array, fn_MxK: jax.Array) -> jax.Array:
  """x @ fnᵀ for bfloat16 x and float32 fn, float32 out, as one bfloat16 tensor-core product:
  fn = fn₁ + fn₂ + fn₃ in bfloat16 terms (exact), so [x·fn₁ | x·fn₂ | x·fn₃] are exact products
  summed in float32, x read once in its own dtype (no float32 copy of the streams)."""
  m = fn_MxK.shape[0]
  y3 = _dot_f32(x_BxK, jnp.concatenate(_bf16_terms(fn_MxK, 3)), "...k,mk->...m")
  return y3[..., :m] + y3[..., m:2 * m] + y3[..., 2 * m:]


def _mix_bf16_fwd(x, fn):
  return _mix_bf16(x, fn), (x, fn)


def _mix_bf16_bwd(res, g):
  """dx = g·fn to 16 bits (g₁fn₁ + g₁fn₂ + g₂fn₁; dx is rounded to bfloat16's 8), one product;
  dfn = (g₁ + g₂ + g₃)ᵀ x exactly, one product over the tokens, float32 sums."""
  x, fn = res
  m = fn.shape[0]
  g1, g2, g3 = _bf16_terms(g, 3)
  f1, f2 = _bf16_terms(fn, 2)
  dx = _dot_f32(jnp.concatenate([g1, g1, g2], -1), jnp.concatenate([f1, f2, f1]), "...m,mk->...k")
  lead = tuple(range(x.ndim - 1))
  d3 = jax.lax.dot_general(jnp.concatenate([g1, g2, g3], -1), x, ((lead, lead), ((), ())),
                           preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), (d3[:m] + d3[m:2 * m] + d3[2 * m:]).astype(fn.dtype)


_mix_bf16.defvjp(_mix_bf16_fwd, _mix_bf16_bwd)


def hc_mix(X_BxTxNxD: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
  """mix = (x̂ @ fnᵀ) · ρ [B, T, (2+n)n] float32, x̂ = X flattened over (n, d), ρ its RMS⁻¹ (§3.2).

  Float32 streams: one float32 product at HIGHEST precision. Bfloat16 streams (§3.5): the same
  values from one bfloat16 tensor-core product over x̂ as stored (`_mix_bf16`)."""
  *lead, n, d = X_BxTxNxD.shape
  x = X_BxTxNxD.reshape(*lead, n * d)
  mean_square = checkpoint_name(
      jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True) + norm_eps, MIX)
  if x.dtype == jnp.bfloat16:
    y = _mix_bf16(x, fn.astype(jnp.float32))
  else:
    y = jnp.einsum("...k,mk->...m", x.astype(jnp.float32), fn.astype(jnp.float32),
                   precision=_HIGHEST)
  return checkpoint_name(y, MIX) * jax.lax.rsqrt(mean_square)


def hc_coefficients(X_BxTxNxD: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *,
                    iters: int, hc_eps: float, norm_eps: float
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(pre_BxTxN, post_BxTxN, comb_BxTxNxN) of one mHC site, float32 (§3.2; see module doc)."""
  *lead, n, _ = X_BxTxNxD.shape
  mix = hc_mix(X_BxTxNxD, fn, norm_eps)
  base = base.astype(jnp.float32)
  scale = scale.astype(jnp.float32)
  # base [(2+n)n], or per token [.., (2+n)n] (a test's per-token copies, test_model.py)
  pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[..., :n]) + hc_eps
  post = 2.0 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[..., n:2 * n])
  logits = (mix[..., 2 * n:] * scale[2] + base[..., 2 * n:]).reshape(*lead, n, n)
  return pre, post, sinkhorn_project(logits, iters, hc_eps)


# --- expand ------------------------------------------------------------------------------------

def _expand_f32(X, post, comb, F):
  n = X.shape[-2]
  X, post, comb, F = (a.astype(jnp.float32) for a in (X, post, comb, F))
  out = post[..., :, None] * F[..., None, :]
  for j in range(n):
    out = out + comb[..., j, :, None] * X[..., j:j + 1, :]
  return out


@jax.custom_vjp
def expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, f_out_BxTxD):
  """New streams X'_k = post_k · F + Σ_j comb[j, k] · X_j (combᵀ X), X's dtype out (module doc)."""
  return _expand_f32(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, f_out_BxTxD).astype(X_BxTxNxD.dtype)


def _expand_fwd(X, post, comb, F):
  return expand(X, post, comb, F), (X, post, comb, F)


def _expand_bwd(res, g):
  X, post, comb, F = res
  n = X.shape[-2]
  g = g.astype(jnp.float32)
  c = comb.astype(jnp.float32)
  p = post.astype(jnp.float32)
  X32, F32 = X.astype(jnp.float32), F.astype(jnp.float32)
  gX = c[..., :, 0, None] * g[..., 0:1, :]
  gF = p[..., 0, None] * g[..., 0, :]
  for k in range(1, n):
    gX = gX + c[..., :, k, None] * g[..., k:k + 1, :]
    gF = gF + p[..., k, None] * g[..., k, :]
  gpost = jnp.sum(g * F32[..., None, :], axis=-1)
  gcols = [jnp.sum(g * X32[..., j:j + 1, :], axis=-1) for j in range(n)]
  # The n + 1 row sums over d leave through a barrier, so each is a reduction kernel's output. On
  # the H200 XLA put n of them in one multi-output reduction and fused the last into its
  # consumer, the gates' padded input, as a loop fusion: one thread per (token, k) summing d
  # values 4·d bytes apart from its neighbours', ~0.3 ms a site against ~0.08 by its bytes at
  # s3 (12.6 ms a step, benchmarks/gpu_runs/2026-12-02b/prof_s3.json, pallas_kernels/mhc.py:207).
  gpost, *gcols = jax.lax.optimization_barrier((gpost, *gcols))
  gcomb = jnp.stack(gcols, axis=-2)
  return (gX.astype(X.dtype), gpost.astype(post.dtype), gcomb.astype(comb.dtype),
          gF.astype(F.dtype))


expand.defvjp(_expand_fwd, _expand_bwd)


# --- collapse ----------------------------------------------------------------------------------

@jax.custom_vjp
def collapse(X_BxTxNxD, pre_BxTxN):
  """Sublayer input Σ_i pre_i · X_i [B, T, d], float32 (the math and the result: the sublayer's
  norm reads it before anything is rounded, whatever the streams' dtype); pre may be [n]."""
  n = X_BxTxNxD.shape[-2]
  X = X_BxTxNxD.astype(jnp.float32)
  pre = pre_BxTxN.astype(jnp.float32)
  y = pre[..., 0, None] * X[..., 0, :]
  for i in range(1, n):
    y = y + pre[..., i, None] * X[..., i, :]
  return y


def _collapse_fwd(X, pre):
  return collapse(X, pre), (X, pre)


def _collapse_bwd(res, g):
  X, pre = res
  g = g.astype(jnp.float32)
  gX = pre.astype(jnp.float32)[..., :, None] * g[..., None, :]
  gpre = jnp.sum(X.astype(jnp.float32) * g[..., None, :], axis=-1)
  extra = gpre.ndim - pre.ndim  # pre broadcast over leading axes: sum them out
  gpre = jnp.sum(gpre, axis=tuple(range(extra))) if extra else gpre
  return jnp.broadcast_to(gX, X.shape).astype(X.dtype), gpre.astype(pre.dtype)


collapse.defvjp(_collapse_fwd, _collapse_bwd)


def hc_site(X_BxTxNxD: jax.Array, F_BxTxD: jax.Array, post_BxTxN: jax.Array,
            comb_BxTxNxN: jax.Array, pre_BxTxN: jax.Array, fn: jax.Array, base: jax.Array,
            scale: jax.Array, norm_weight: jax.Array, *, iters: int, hc_eps: float,
            norm_eps: float) -> tuple[jax.Array, ...]:
  """One single-pass site (§3.3) in one function: the op's reference (kernel: `pallas_kernels.mhc.hc_site`).

  X [B,T,n,d] are the streams entering the PREVIOUS site, F [B,T,d] that site's sublayer output
  and (post, comb, pre) its coefficients; fn/base/scale are THIS site's parameters and
  norm_weight its sublayer norm (attn_norm / ffn_norm):

    X'   = expand(X, post, comb, F)                          [B,T,n,d], X's dtype
    x    = rms_norm(collapse(X', pre), norm_weight)          [B,T,d], float32 (sublayer input)
    pre', post', comb' = hc_coefficients(X', fn, base, scale)   this site's coefficients

  Returns (X', x, pre', post', comb'). A model's first site has no previous expand: F = 0,
  post = 0, comb = I reproduce X exactly, with pre = `initial_pre(n)`.
  """
  X_new = expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, F_BxTxD)
  # Coefficients before the collapse: autodiff sums the cotangents of X' in reverse order of its
  # uses, so this order keeps the gradients bit for bit those of the unfused site.
  coefficients = hc_coefficients(X_new, fn, base, scale, iters=iters, hc_eps=hc_eps,
                                 norm_eps=norm_eps)
  x = rms_norm(collapse(X_new, pre_BxTxN), norm_weight, norm_eps)
  return (X_new, x, *coefficients)
