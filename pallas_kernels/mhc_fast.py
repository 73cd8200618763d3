"""The mHC coefficients and single-pass site with the Sinkhorn as a Triton kernel (docs/design.md §3.2–3.3; §T5).

The same functions as the ops' references (`pallas_kernels.ops.mhc.hc_coefficients`, `hc_site`;
the tests compare them) except for the gates:

- `gates` (sigmoids + the Sinkhorn projection, z [.., (2+n)n] -> pre | post | comb) is one Triton
  kernel with the iterations in registers (`pallas_kernels.mhc.gate_rows`), and its backward the
  recomputing kernel of `pallas_kernels.mhc_site` (no stored iterates). The reference's
  `fori_loop` of [T, 4, 4] reductions is a device loop of small launches (0.41–0.67 ms forward
  for 1 MB of data on the H200, against 0.08); written as unrolled XLA code it is ~4,000 tiny ops
  whose CPU compile alone took 3 minutes. Both kernels run per batch shard under a mesh
  (`sharded.over_batch`).
- `hc_coefficients` is the op's mix GEMM and RMS (`hc_mix`), then `gates`; `hc_site` composes
  the op's expand and collapse (broadcast multiply-adds with hand VJPs), the norm and these
  coefficients like the reference. At s3's shapes on the H200 the site is 1.85× the reference
  forward and 1.21× forward+backward (benchmarks/RESULTS.md, issue 27).

Float32 math throughout, outputs in the references' dtypes. `interpret=None` interprets the
kernels on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.mhc import _next_pow2, _triton_params, gate_rows
from pallas_kernels.mhc_site import sinkhorn_gates_vjp
from pallas_kernels.ops.mhc import collapse, expand, hc_mix
from pallas_kernels.ops.norm import rms_norm
from pallas_kernels.sharded import over_batch

_F32 = jnp.float32


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
  *lead, n, _ = X_BxTxNxD.shape
  mix = hc_mix(X_BxTxNxD, fn, norm_eps)
  s = scale.astype(_F32)
  scale_cols = jnp.concatenate([jnp.full((n,), s[0]), jnp.full((n,), s[1]),
                                jnp.full((n * n,), s[2])])
  out = gates(mix * scale_cols + base.astype(_F32),
              (n, iters, hc_eps, block_tokens, _interpret(interpret)))
  return out[..., :n], out[..., n:2 * n], out[..., 2 * n:].reshape(*lead, n, n)


# --- the single-pass site ----------------------------------------------------------------------

def hc_site(X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN, fn, base, scale,
            norm_weight, *, iters: int, hc_eps: float, norm_eps: float, block_tokens: int = 16,
            interpret: bool | None = None):
  """(X', x, pre', post', comb') of one single-pass site (`layers.mhc.hc_site`)."""
  X_new = expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, F_BxTxD)
  x = rms_norm(collapse(X_new, pre_BxTxN), norm_weight, norm_eps)
  return (X_new, x, *hc_coefficients(X_new, fn, base, scale, iters=iters, hc_eps=hc_eps,
                                     norm_eps=norm_eps, block_tokens=block_tokens,
                                     interpret=interpret))


def unsupported_reason(*args, **kwargs) -> str | None:
  """None: XLA code and a Triton kernel on [tokens, (2+n)n] logits take every shape the
  reference takes (Triton on a GPU, interpreted on the CPU)."""
  return None
