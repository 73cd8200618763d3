"""Acceptance of k drafted tokens against the backbone's verification (docs/design.md §16.3).

The backbone verified [x_t, d_1 … d_k] in one pass: its distributions p_1 … p_{k+1} (p_i of the
token after d_{i−1}; p_{k+1} after d_k). Both rules return n, the number of drafts accepted
(0 … k), and the next token: the correction at the first rejection, or the bonus token from
p_{k+1} when all k are accepted, so a round always yields n + 1 tokens.

  greedy    d_i accepted iff d_i = argmax p_i; next = argmax p_{n+1}. The output is exactly the
            backbone's greedy sequence.
  sampling  d_i (drawn from the drafter's q_i) accepted with probability min(1, p_i(d_i) / q_i(d_i));
            at the first rejection the next token is drawn from (p_i − q_i)⁺ normalised, else from
            p_{k+1}. Each emitted token is then distributed as the backbone's p (Leviathan et al.
            2023, Chen et al. 2023), whatever q is.

`k_B` (≤ k) caps the drafts a row verifies: the scheduler's per-request length in a pass of k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _leading(accepted_Bxk: jax.Array) -> jax.Array:
  """Length of the run of accepted drafts from the first one."""
  return jnp.sum(jnp.cumprod(accepted_Bxk.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def greedy_accept(drafts_Bxk, target_logits_BxQxV, k_B=None) -> tuple[jax.Array, jax.Array]:
  """(n [B], next [B]) of the greedy rule; Q = k + 1."""
  B, k = drafts_Bxk.shape
  best = jnp.argmax(target_logits_BxQxV, axis=-1).astype(jnp.int32)        # [B, k+1]
  ok = drafts_Bxk == best[:, :k]
  if k_B is not None:
    ok = ok & (jnp.arange(k) < k_B[:, None])
  n = _leading(ok)
  return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def rejection_accept(drafts_Bxk, q_BxkxV, p_BxQxV, key, k_B=None) -> tuple[jax.Array, jax.Array]:
  """(n [B], next [B]) of the sampling rule; p and q are probabilities, Q = k + 1."""
  B, k = drafts_Bxk.shape
  ku, kn = jax.random.split(key)
  at = lambda x: jnp.take_along_axis(x, drafts_Bxk[..., None], axis=-1)[..., 0]
  p_d, q_d = at(p_BxQxV[:, :k]), at(q_BxkxV)
  u = jax.random.uniform(ku, (B, k))
  ok = u * q_d < p_d                                       # u < p/q, without dividing by q = 0
  limit = jnp.full((B,), k, jnp.int32) if k_B is None else k_B.astype(jnp.int32)
  ok = ok & (jnp.arange(k) < limit[:, None])
  n = _leading(ok)
  p_n = jnp.take_along_axis(p_BxQxV, n[:, None, None], axis=1)[:, 0]      # [B, V]
  q_pad = jnp.concatenate([q_BxkxV, jnp.zeros_like(p_BxQxV[:, :1])], axis=1)
  q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  mass = residual.sum(-1, keepdims=True)
  rejected = (n < limit)[:, None] & (mass > 0)
  dist = jnp.where(rejected, residual / jnp.where(mass > 0, mass, 1.0), p_n)
  nxt = jax.random.categorical(kn, jnp.log(dist), axis=-1).astype(jnp.int32)
  return n, nxt
