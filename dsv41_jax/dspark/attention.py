"""The drafter's attention (docs/design.md §16.1): pure functions of arrays.

Two kinds of rows attend. A *context* row j (the fused backbone state h_{j−1} and embedding of
x_j) reads the context rows of its document in its window, j − W < s ≤ j (causal sliding window,
`swa_visible` of `pallas_kernels/ops/sparse_attention.py`). The K *draft queries* of anchor t
read the context rows anchor t reads and the queries of their own block up to themselves (query i sees queries 1 … i), never
another anchor's. In training every row of a sequence is an anchor and all T·K queries run at once
(`train_attention`); in decoding the context rows of each layer are kept in a ring of W keys and
values, the new rows of a round and then the queries attend over the ring and their own block
(`ring_attention`). Both are one softmax over the two key sets, fp32 scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_MASKED = -1e30   # finite: a padding row that sees nothing stays finite (its output is unused)


def _joint_softmax(s1, m1, s2, m2):
  """Softmax over the concatenation of two masked score sets; returns the two probability parts."""
  s1 = jnp.where(m1, s1, _MASKED)
  s2 = jnp.where(m2, s2, _MASKED)
  p = jax.nn.softmax(jnp.concatenate([s1, s2], axis=-1), axis=-1)
  return p[..., :s1.shape[-1]], p[..., s1.shape[-1]:]


def train_attention(qc_BxTxHxd, kc_BxTxHxd, vc_BxTxHxd, qu_BxTxKxHxd, ku_BxTxKxHxd, vu_BxTxKxHxd,
                    visible_BxTxT: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """(context outputs [B, T, H, d], query outputs [B, T, K, H, d]) for every anchor of the rows.

  `visible_BxTxT[b, t, s]`: context row s is in row t's window and document."""
  f = lambda x: x.astype(_F32)
  K = qu_BxTxKxHxd.shape[2]
  s_cc = jnp.einsum("bthd,bshd->bhts", f(qc_BxTxHxd), f(kc_BxTxHxd)) * scale
  s_cc = jnp.where(visible_BxTxT[:, None], s_cc, _MASKED)
  o_c = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s_cc, axis=-1), f(vc_BxTxHxd))
  s_uc = jnp.einsum("btkhd,bshd->btkhs", f(qu_BxTxKxHxd), f(kc_BxTxHxd)) * scale
  s_uu = jnp.einsum("btkhd,btjhd->btkhj", f(qu_BxTxKxHxd), f(ku_BxTxKxHxd)) * scale
  causal = jnp.tril(jnp.ones((K, K), bool))[None, None, :, None, :]
  p_uc, p_uu = _joint_softmax(s_uc, visible_BxTxT[:, :, None, None, :], s_uu, causal)
  o_u = (jnp.einsum("btkhs,bshd->btkhd", p_uc, f(vc_BxTxHxd))
         + jnp.einsum("btkhj,btjhd->btkhd", p_uu, f(vu_BxTxKxHxd)))
  return o_c.astype(qc_BxTxHxd.dtype), o_u.astype(qu_BxTxKxHxd.dtype)


def ring_attention(q_BxSxHxd, ring_k_BxWxHxd, ring_v_BxWxHxd, ring_ok_SxW: jax.Array,
                   new_k_BxSxHxd, new_v_BxSxHxd, new_ok_SxS: jax.Array, scale: float) -> jax.Array:
  """Outputs [B, S, H, d] of S rows over the ring's keys (where `ring_ok`) and the S rows' own
  keys (where `new_ok`)."""
  f = lambda x: x.astype(_F32)
  s_r = jnp.einsum("bshd,bwhd->bhsw", f(q_BxSxHxd), f(ring_k_BxWxHxd)) * scale
  s_n = jnp.einsum("bshd,bjhd->bhsj", f(q_BxSxHxd), f(new_k_BxSxHxd)) * scale
  p_r, p_n = _joint_softmax(s_r, ring_ok_SxW[None, None], s_n, new_ok_SxS[None, None])
  o = (jnp.einsum("bhsw,bwhd->bshd", p_r, f(ring_v_BxWxHxd))
       + jnp.einsum("bhsj,bjhd->bshd", p_n, f(new_v_BxSxHxd)))
  return o.astype(q_BxSxHxd.dtype)
