"""The DSpark drafter module (docs/design.md §16.1, §16.2).

Inputs at context row j: the backbone's final hidden state h_{j−1} (the head's input,
`inference.verify.final_hidden`; zero at a document's first row) and the backbone's embedding of
x_j, each RMS-normalised, concatenated and fused to width D:  f_j = [n(h_{j−1}); n(e(x_j))] · W_f.
Row j thus knows the token the backbone sampled from h_{j−1}. Anchor t (the newest row) gets K
draft queries (learned vectors, RoPE positions t+1 … t+K); 3 blocks (pre-norm attention with
RoPE over the 128-row window, `attention.py`, and a SwiGLU MLP) run the rows and the queries;
the final norm of query i, z_i, gives base logits through the backbone's own (frozen) head:

  base_i  = z_i · head                                   [V], all K in one pass
  logit_i = base_i + A[x_prev] · B                       the Markov head: a rank-r bigram term of
                                                         the previous draft token (x_t for i = 1)
  c_i     = σ(MLP([sg(z_i); max log q_i; entropy q_i]))  the confidence head: P(d_i accepted |
                                                         d_1 … d_{i−1} accepted), q_i = softmax(logit_i)

Drafting k ≤ K tokens is then a loop over the Markov head only (`draft`): no second pass.
`DraftCache` holds per layer the ring of the last W context rows' keys and values; `extend`
adds a round's accepted rows and returns the queries' z and base logits.

Shapes: B batch, T rows, K draft positions, D width, H heads, d head width, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.dspark.attention import ring_attention, train_attention
from dsv41_jax.dspark.config import DrafterConfig
from dsv41_jax.layers import rope
from dsv41_jax.layers.norm import RMSNorm
from pallas_kernels.ops.sparse_attention import swa_visible


class DraftCache(NamedTuple):
  """Per drafter layer, the ring of the last W context rows: keys and values [B, W, H, d]
  (row p in slot p mod W), and the position each slot holds, pos_W (−1 = empty)."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  pos_W: jax.Array


class DrafterBlock(nnx.Module):
  """Pre-norm attention (q, k, v, o projections, RoPE) and a SwiGLU MLP, both residual."""

  def __init__(self, dc: DrafterConfig, rngs: nnx.Rngs):
    D, H, d, F = dc.hidden_size, dc.num_heads, dc.head_dim, dc.mlp_ratio * dc.hidden_size
    p = lambda shape, axes, fan: sharding.param(rngs, shape, axes, sharding.fan_in_normal(fan))
    self.attn_norm = RMSNorm(D, dc.rms_norm_eps, rngs)
    self.wq = p((D, H, d), ("embed", "heads", "head_dim"), (0,))
    self.wk = p((D, H, d), ("embed", "heads", "head_dim"), (0,))
    self.wv = p((D, H, d), ("embed", "heads", "head_dim"), (0,))
    self.wo = p((H, d, D), ("heads", "head_dim", "embed"), (0, 1))
    self.mlp_norm = RMSNorm(D, dc.rms_norm_eps, rngs)
    self.w1 = p((D, F), ("embed", "mlp"), (0,))
    self.w3 = p((D, F), ("embed", "mlp"), (0,))
    self.w2 = p((F, D), ("mlp", "embed"), (0,))

  def qkv(self, x, positions, inv_freq):
    """(q, k, v) [..., H, d] of rows x [..., D] at `positions` [...] (RoPE on q and k)."""
    n = self.attn_norm(x)
    q, k, v = (jnp.einsum("...d,dhe->...he", n, w[...].astype(x.dtype))
               for w in (self.wq, self.wk, self.wv))
    return rope.apply_rope(q, positions, inv_freq), rope.apply_rope(k, positions, inv_freq), v

  def finish(self, x, o):
    """x + attention output o [..., H, d] projected, then + the MLP."""
    x = x + jnp.einsum("...he,hed->...d", o, self.wo[...].astype(x.dtype))
    n = self.mlp_norm(x)
    a = jnp.einsum("...d,df->...f", n, self.w1[...].astype(x.dtype))
    b = jnp.einsum("...d,df->...f", n, self.w3[...].astype(x.dtype))
    return x + jnp.einsum("...f,fd->...d", jax.nn.silu(a) * b, self.w2[...].astype(x.dtype))


class Drafter(nnx.Module):
  """The drafter's weights (module docstring); the backbone's embedding and head are arguments."""

  def __init__(self, dc: DrafterConfig, rngs: nnx.Rngs):
    self.dc = dc
    D, V, K = dc.hidden_size, dc.vocab_size, dc.draft_len
    self.hidden_norm = RMSNorm(D, dc.rms_norm_eps, rngs)
    self.embed_norm = RMSNorm(D, dc.rms_norm_eps, rngs)
    self.fuse = sharding.param(rngs, (2 * D, D), (None, "embed"), sharding.fan_in_normal((0,)))
    self.queries = sharding.param(rngs, (K, D), (None, "embed"), sharding.normal(1.0))
    self.blocks = nnx.List([DrafterBlock(dc, rngs) for _ in range(dc.num_layers)])
    self.final_norm = RMSNorm(D, dc.rms_norm_eps, rngs)
    r, C = dc.markov_rank, dc.confidence_width
    self.markov_in = sharding.param(rngs, (V, r), ("vocab", None), sharding.normal(1.0))
    # Zero output: the Markov term starts as nothing, so early training is the base logits.
    self.markov_out = sharding.param(rngs, (r, V), (None, "vocab"), sharding.constant(0.0))
    self.conf_w1 = sharding.param(rngs, (D + 2, C), ("embed", None), sharding.fan_in_normal((0,)))
    self.conf_b1 = sharding.param(rngs, (C,), (None,), sharding.constant(0.0))
    self.conf_w2 = sharding.param(rngs, (C,), (None,), sharding.fan_in_normal((0,)))
    self.conf_b2 = sharding.param(rngs, (), (), sharding.constant(0.0))

  @property
  def inv_freq(self):
    return rope.rope_inv_freq(self.dc.head_dim, self.dc.rope_theta)

  @property
  def scale(self) -> float:
    return self.dc.head_dim ** -0.5

  # --- pieces -------------------------------------------------------------------------------

  def features(self, h_prev_BxTxD, emb_BxTxD):
    """f_j = [n(h_{j−1}); n(e(x_j))] · W_f  [B, T, D]."""
    dt = jnp.dtype(self.dc.dtype)
    x = jnp.concatenate([self.hidden_norm(h_prev_BxTxD.astype(dt)),
                         self.embed_norm(emb_BxTxD.astype(dt))], axis=-1)
    return jnp.einsum("btc,cd->btd", x, self.fuse[...].astype(dt))

  def base_logits(self, z, head_DxV):
    return jnp.einsum("...d,dv->...v", z, jax.lax.stop_gradient(head_DxV).astype(z.dtype),
                      preferred_element_type=jnp.float32)

  def markov(self, prev_tokens):
    """The Markov head's logit term [..., V] of the previous tokens [...]."""
    a = jnp.take(self.markov_in[...], prev_tokens, axis=0)
    return jnp.einsum("...r,rv->...v", a, self.markov_out[...], preferred_element_type=jnp.float32)

  def confidence_logit(self, z, logits):
    """The confidence head's logit [...] of queries z [..., D] with draft logits [..., V]; it reads
    nothing it could push gradients into (z and the logits are stopped)."""
    z, logits = jax.lax.stop_gradient(z), jax.lax.stop_gradient(logits)
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    stats = jnp.stack([jnp.max(logq, axis=-1), -jnp.sum(jnp.exp(logq) * logq, axis=-1)], axis=-1)
    x = jnp.concatenate([z.astype(jnp.float32), stats], axis=-1)
    hdn = jax.nn.gelu(x @ self.conf_w1[...] + self.conf_b1[...])
    return hdn @ self.conf_w2[...] + self.conf_b2[...]

  def _query_inputs(self, lead_shape):
    dt = jnp.dtype(self.dc.dtype)
    return jnp.broadcast_to(self.queries[...].astype(dt), (*lead_shape, *self.queries.shape))

  # --- training: every row an anchor -----------------------------------------------------------

  def __call__(self, h_BxTxD, tokens_BxT, positions_BxT, segment_ids_BxT, embed_VxD, head_DxV):
    """(z [B, T, K, D], base logits [B, T, K, V]) of the K queries at every anchor t of the rows
    (h: the backbone's final hidden states of the same rows; embed, head: its weights)."""
    emb = jnp.take(jax.lax.stop_gradient(embed_VxD), tokens_BxT, axis=0)
    h = jax.lax.stop_gradient(h_BxTxD)
    h_prev = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    h_prev = jnp.where((positions_BxT > 0)[..., None], h_prev, 0)
    c = self.features(h_prev, emb)
    B, T = tokens_BxT.shape
    K = self.dc.draft_len
    u = self._query_inputs((B, T))
    qpos = positions_BxT[..., None] + 1 + jnp.arange(K)
    visible = swa_visible(segment_ids_BxT, self.dc.sliding_window)
    for blk in self.blocks:
      qc, kc, vc = blk.qkv(c, positions_BxT, self.inv_freq)
      qu, ku, vu = blk.qkv(u, qpos, self.inv_freq)
      oc, ou = train_attention(qc, kc, vc, qu, ku, vu, visible, self.scale)
      c, u = blk.finish(c, oc), blk.finish(u, ou)
    z = self.final_norm(u)
    return z, self.base_logits(z, head_DxV)

  # --- decoding: a ring of context rows per layer --------------------------------------------

  def init_cache(self, batch: int) -> DraftCache:
    dc = self.dc
    shape = (batch, dc.sliding_window, dc.num_heads, dc.head_dim)
    z = lambda: tuple(jnp.zeros(shape, jnp.dtype(dc.dtype)) for _ in range(dc.num_layers))
    return DraftCache(z(), z(), jnp.full((dc.sliding_window,), -1, jnp.int32))

  def extend(self, cache: DraftCache, h_prev_BxSxD, tokens_BxS, first, n_new, embed_VxD, head_DxV):
    """Add context rows first … first+n_new−1 (the first n_new of S; rows past n_new are padding)
    and run the queries of anchor first+n_new−1: (z [B, K, D], base logits [B, K, V], cache)."""
    dc = self.dc
    W, K = dc.sliding_window, dc.draft_len
    B, S = tokens_BxS.shape
    first = jnp.asarray(first, jnp.int32)
    c = self.features(h_prev_BxSxD, jnp.take(embed_VxD, tokens_BxS, axis=0))
    pos = first + jnp.arange(S, dtype=jnp.int32)                         # [S]
    valid = jnp.arange(S) < n_new
    anchor = first + n_new - 1
    u = self._query_inputs((B,))
    qpos = anchor + 1 + jnp.arange(K, dtype=jnp.int32)
    old_ok = (cache.pos_W >= 0) & (cache.pos_W[None, :] > pos[:, None] - W)       # [S, W]
    new_ok = jnp.tril(jnp.ones((S, S), bool)) & valid[None, :]
    slots = pos % W
    ks, vs = [], []
    pos_W = jnp.where(valid, pos, cache.pos_W[slots])
    ring_pos = cache.pos_W.at[slots].set(pos_W)
    ring_ok = (ring_pos >= 0) & (ring_pos > anchor - W) & (ring_pos <= anchor)      # [W]
    for blk, rk, rv in zip(self.blocks, cache.k, cache.v):
      qc, kc, vc = blk.qkv(c, jnp.broadcast_to(pos, (B, S)), self.inv_freq)
      oc = ring_attention(qc, rk, rv, old_ok, kc, vc, new_ok, self.scale)
      keep = valid[None, :, None, None]
      rk = rk.at[:, slots].set(jnp.where(keep, kc, rk[:, slots]))
      rv = rv.at[:, slots].set(jnp.where(keep, vc, rv[:, slots]))
      qu, ku, vu = blk.qkv(u, jnp.broadcast_to(qpos, (B, K)), self.inv_freq)
      ou = ring_attention(qu, rk, rv, jnp.broadcast_to(ring_ok, (K, W)), ku, vu,
                          jnp.tril(jnp.ones((K, K), bool)), self.scale)
      c, u = blk.finish(c, oc), blk.finish(u, ou)
      ks.append(rk)
      vs.append(rv)
    z = self.final_norm(u)
    return z, self.base_logits(z, head_DxV), DraftCache(tuple(ks), tuple(vs), ring_pos)


def draft(drafter: Drafter, z_BxKxD, base_BxKxV, prev_B, k: int, key, temperature: float):
  """Draft k ≤ K tokens through the Markov head: (tokens [B, k], the distributions they were drawn
  from [B, k, V] (one-hot at temperature 0: argmax), confidences c_i [B, k])."""
  toks, dists, confs = [], [], []
  prev = prev_B
  for i in range(k):
    logits = base_BxKxV[:, i] + drafter.markov(prev)
    conf = jax.nn.sigmoid(drafter.confidence_logit(z_BxKxD[:, i], logits))
    if temperature <= 0:
      tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      dist = jax.nn.one_hot(tok, logits.shape[-1], dtype=jnp.float32)
    else:
      key, sub = jax.random.split(key)
      scaled = logits / temperature
      tok = jax.random.categorical(sub, scaled, axis=-1).astype(jnp.int32)
      dist = jax.nn.softmax(scaled, axis=-1)
    toks.append(tok)
    dists.append(dist)
    confs.append(conf)
    prev = tok
  if not toks:
    B, V = base_BxKxV.shape[0], base_BxKxV.shape[-1]
    return jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, V)), jnp.zeros((B, 0))
  return jnp.stack(toks, 1), jnp.stack(dists, 1), jnp.stack(confs, 1)


def init_drafter(dc: DrafterConfig, seed: int = 0) -> Drafter:
  return Drafter(dc, nnx.Rngs(seed))
