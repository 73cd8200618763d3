"""The mHC kernels: coefficients and the single-pass site with the gates as Triton kernels (docs/design.md §3.2–3.3; §T5).

The kernels of the ops `hc_coefficients` and `hc_site` (`pallas_kernels.ops.mhc`, whose
docstring has the equations; the tests compare them). They compute the same functions as the
references except for the gates:

- `gates` (sigmoids + the Sinkhorn projection, logits z [.., (2+n)n] -> pre | post | comb) is one
  Triton kernel with the iterations in registers (`gate_rows`), and its backward a second kernel
  that rebuilds the iterates in registers by segment checkpointing (no iterates in memory,
  O(iters) normalisations). The reference's `fori_loop` of [T, 4, 4] reductions is a device
  loop of small launches: on the H200 at s3's shapes
  [16384, 24] it took 0.41–0.67 ms forward and 0.77–0.87 ms forward+backward against the kernels'
  0.08 and 0.34 (benchmarks/RESULTS.md, issue 27). Unrolled as XLA code it is ~4,000 tiny ops
  whose CPU compile alone took 3 minutes.
- The mix x̂ · fnᵀ stays the op's `hc_mix` (a cuBLAS SGEMM, ~0.14 ms a site at s3): a Triton
  kernel computing it and Σ x̂² in one read of the streams with float32 FMA dots took 43.9 ms of
  the s3 step against 19.9 (benchmarks/RESULTS.md, 2026-12-02 second session) and was removed.
- `hc_coefficients` is the op's `hc_mix`, then `gates`; `hc_site` composes the op's expand and
  collapse (broadcast multiply-adds with hand VJPs), the norm and these coefficients like the
  reference. At s3's shapes the site was 1.85× the reference forward and 1.21× forward+backward
  with the op's mix (RESULTS.md, issue 27).

Float32 math throughout, outputs in the references' dtypes. The dispatcher runs both kernels per
batch shard under a mesh (`sharded.over_batch`). Token counts the blocks do not tile are padded
(logged once). `interpret=None` interprets the kernels on the CPU and compiles them with Triton on
the GPU (`gpu` backend).

Layout of a gate row (P = R·n with R = the next power of two ≥ 2+n, zero padding columns):
group 0 = pre, group 1 = post, groups 2 … n+1 = comb rows j (comb[j, k] at column (2+j)·n + k),
further groups are padding. Triton blocks are powers of two, so on the GPU n must be one (1, 2,
4, 8).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels.notices import log_once
from pallas_kernels.ops.mhc import MIX, collapse, expand, hc_mix
from pallas_kernels.ops.norm import rms_norm

_F32 = jnp.float32


def _triton_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(v: int) -> int:
  return 1 << (v - 1).bit_length()


def _col_norm(c, eps):  # c [bt, groups, n]: divide each column k by (Σ_j c[j, k] + eps)
  return c / (jnp.sum(c, axis=1, keepdims=True) + eps)


def _row_norm(c, eps):
  return c / (jnp.sum(c, axis=2, keepdims=True) + eps)


def _tokens_tiled(tokens: int, block_tokens: int, what: str) -> int:
  padded = pl.cdiv(tokens, block_tokens) * block_tokens
  if padded != tokens:
    log_once((what, tokens, block_tokens),
             f"{what}: {tokens} tokens are not tiled by {block_tokens}; padding to {padded}")
  return padded


def _gate_call(kernel, name, arrays, *, n, block_tokens, interpret):
  """`kernel` on [tokens, P] rows of each array [.., (2+n)n] (padded), -> [.., (2+n)n] float32."""
  lead, m = arrays[0].shape[:-1], arrays[0].shape[-1]
  tokens = int(np.prod(lead))
  p = _next_pow2(2 + n) * n
  padded = _tokens_tiled(tokens, block_tokens, name)
  rows = [jnp.pad(a.reshape(tokens, m).astype(_F32), ((0, padded - tokens), (0, p - m)))
          for a in arrays]
  row = pl.BlockSpec((block_tokens, p), lambda i: (i, 0))
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((padded, p), _F32),
      grid=(padded // block_tokens,),
      in_specs=[row] * len(rows),
      out_specs=row,
      compiler_params=None if interpret else _triton_params(4, 1),
      interpret=interpret,
      name=name,
  )(*rows)
  return out[:tokens, :m].reshape(*lead, m)


# --- forward: the gates in registers -----------------------------------------------------------

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


def _gates_kernel(z_ref, o_ref, *, n: int, groups: int, iters: int, hc_eps: float):
  o_ref[...] = gate_rows(z_ref[...], n=n, groups=groups, iters=iters, hc_eps=hc_eps)


# --- backward: the Sinkhorn iterates rebuilt in registers --------------------------------------

def _gates_bwd_kernel(z_ref, g_ref, o_ref, *, n: int, groups: int, iters: int, hc_eps: float):
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

  def step(t, c):
    return _col_norm(c, hc_eps) if t % 2 == 0 else _row_norm(c, hc_eps)

  def norm_bwd(c, gc, axis):  # c' = c / (Σ_axis c + eps): gc = (gc' − Σ_axis gc'·c') / (Σ + eps)
    s = jnp.sum(c, axis=axis, keepdims=True) + hc_eps
    return (gc - jnp.sum(gc * (c / s), axis=axis, keepdims=True)) / s

  # Each step's input by segment checkpointing, unrolled (static parities): one forward sweep
  # keeps the first input of every segment of `seg` = ⌊√steps⌋ steps, and a segment's other
  # inputs are rebuilt from it just before its backward. At 20 iterations that is 68
  # normalisations and 39 backward steps in sequence, against 741 and 39 when each step's input
  # was rebuilt from the softmax (a loop of loops); the same operations per step (within 2.4e-7
  # of that kernel's gradients, interpreted: the compiler's contractions differ). Registers:
  # ~2√steps iterates of the [bt, groups, n] tile.
  seg = max(1, math.isqrt(steps))
  starts = list(range(0, steps, seg))
  firsts, c = [c0], c0
  for t in range(starts[-1]):
    c = step(t, c)
    if (t + 1) % seg == 0:
      firsts.append(c)
  gc = jnp.where(is_comb, g3, 0.0)
  for start, c in reversed(list(zip(starts, firsts))):
    inputs = [c]
    for t in range(start, min(start + seg, steps) - 1):
      inputs.append(step(t, inputs[-1]))
    for t in reversed(range(start, start + len(inputs))):
      gc = norm_bwd(inputs[t - start], gc, 1 if t % 2 == 0 else 2)
      gc = jnp.where(is_comb, gc, 0.0)  # padding groups carry nothing (their c is 0)
  g_soft = prob * (gc - jnp.sum(gc * prob, axis=2, keepdims=True))
  o_ref[...] = (g_gates + jnp.where(is_comb, g_soft, 0.0)).reshape(bt, groups * n)


def gates_vjp(z, g, *, n: int, iters: int, hc_eps: float, block_tokens: int = 16,
              interpret: bool = False):
  """dL/dz for (pre, post, comb)(z) of §3.2, z and g packed as [.., pre n | post n | comb n·n]."""
  kernel = functools.partial(_gates_bwd_kernel, n=n, groups=_next_pow2(2 + n), iters=iters,
                             hc_eps=hc_eps)
  return _gate_call(kernel, "mhc_gates_bwd", (z, g), n=n, block_tokens=block_tokens,
                    interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gates(z, static):
  """(pre | post | comb rows) [.., (2+n)n] from the logits z of §3.2 (module doc), float32;
  static = (n, iters, hc_eps, block_tokens, interpret)."""
  n, iters, hc_eps, block_tokens, interpret = static
  kernel = functools.partial(_gates_kernel, n=n, groups=_next_pow2(2 + n), iters=iters,
                             hc_eps=hc_eps)
  return _gate_call(kernel, "mhc_gates", (z,), n=n, block_tokens=block_tokens,
                    interpret=interpret)


def _gates_fwd(z, static):
  return gates(z, static), z


def _gates_bwd(static, z, g):
  n, iters, hc_eps, block_tokens, interpret = static
  return (gates_vjp(z, g, n=n, iters=iters, hc_eps=hc_eps, block_tokens=block_tokens,
                    interpret=interpret),)


gates.defvjp(_gates_fwd, _gates_bwd)


# --- the ops' kernels --------------------------------------------------------------------------

def _interpret(interpret):
  return jax.default_backend() == "cpu" if interpret is None else interpret


def hc_coefficients(X_BxTxNxD, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float,
                    block_tokens: int = 16, interpret: bool | None = None):
  """Kernel of the op `hc_coefficients`: (pre, post, comb) of one site, float32 (module doc)."""
  return coefficients_of_mix(hc_mix(X_BxTxNxD, fn, norm_eps), base, scale, n=X_BxTxNxD.shape[-2],
                             iters=iters, hc_eps=hc_eps, block_tokens=block_tokens,
                             interpret=interpret)


def coefficients_of_mix(mix, base, scale, *, n: int, iters: int, hc_eps: float,
                        block_tokens: int = 16, interpret: bool | None = None):
  """(pre, post, comb) from the site's mix [.., (2+n)n] (`hc_mix`'s, ρ applied): the scaled and
  shifted logits through the `gates` kernel, float32."""
  s = scale.astype(_F32)
  scale_cols = jnp.concatenate([jnp.full((n,), s[0]), jnp.full((n,), s[1]),
                                jnp.full((n * n,), s[2])])
  # Named for remat like the mix (`ops.mhc.MIX`): the gates' backward needs only their logits, so
  # layer remat need not run the forward kernel again for the recomputed expand and collapse.
  out = checkpoint_name(gates(mix * scale_cols + base.astype(_F32),
                              (n, iters, hc_eps, block_tokens, _interpret(interpret))), MIX)
  return out[..., :n], out[..., n:2 * n], out[..., 2 * n:].reshape(*mix.shape[:-1], n, n)


def hc_site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
            norm_weight, *, iters: int, hc_eps: float, norm_eps: float, block_tokens: int = 16,
            interpret: bool | None = None):
  """Kernel of the op `hc_site`: (X', x, pre', post', comb') of one single-pass site."""
  # X' leaves as bfloat16 (the streams' dtype), and the collapse, the mix and, in the backward,
  # the next expand's column sums all read that. Without the barrier XLA kept expand's float32
  # sum as well, to fuse into each reader: on the H100 37 f32 [4, 4096, 4, 1024] buffers a
  # micro-batch at s3 (6.3 ms of writes, each read again by two or three fusions;
  # benchmarks/gpu_runs/2026-12-06/s57_prof, `loop_add_fusion` at this function's expand).
  X_new = jax.lax.optimization_barrier(expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, F_BxTxD))
  x = rms_norm(collapse(X_new, pre_BxTxN), norm_weight, norm_eps)
  return (X_new, x, *hc_coefficients(X_new, fn, base, scale, iters=iters, hc_eps=hc_eps,
                                     norm_eps=norm_eps, block_tokens=block_tokens,
                                     interpret=interpret))


def unsupported_reason(X_BxTxNxD, *_, **__) -> str | None:
  """Why the kernels cannot take these streams here (None if they can): the rest is XLA code, and
  compiled for the GPU the gate kernels' [tokens, next_pow2(2+n)·n] blocks must be powers of two,
  so n must be one (interpreted on the CPU, any n runs)."""
  n = X_BxTxNxD.shape[-2]
  if jax.default_backend() == "gpu" and n & (n - 1):
    return (f"hc_mult {n}: the gate rows ({_next_pow2(2 + n) * n} columns) are not a power of "
            "two (Triton blocks)")
  return None
