"""Engram conditional memory layer (docs/design.md §7.3, V4.1 form without the short conv).

Shapes, per Engram layer (H = n_orders·n_heads hash heads, D_e = engram_head_dim, N = hc_mult,
d = hidden_size):
  hash_ids [B, T, H] (host-computed, `dsv41_jax.engram.hashing`)
  → E  = table[hash_ids]                    [B, T, H, D_e]   row-sharded lookup over `engram`
  → e  = E.reshape                          [B, T, H·D_e]
  → kv = e @ w_ekv                          [B, T, (N+1)·d]  N stream keys + one shared value
  → α  = gate(X, k, q_w ⊙ k_w)              [B, T, N]        closed where token_mask is False
  → X + α·v                                 [B, T, N, d]     before the layer's attention-mHC

Parameters (paths `engram/...`): `table` [rows, D_e] ("engram_rows", "engram_dim"), all (order,
head) sub-tables concatenated by row offset, rows padded up to a multiple of 1024 (never
addressed); `w_ekv` [H·D_e, (N+1)·d] ("engram_in", "engram_out"); `q_w`, `k_w` [N, d] (RMSNorm
weights, init 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.engram import hashing, lookup

# Table init N(0, 1), the embedding default of the reference demo [INF]: with w_ekv at fan-in
# scale the keys and the value start at unit RMS.
TABLE_INIT_STD = 1.0


class FP8Table(nnx.Variable):
  """Frozen FP8 table storage (values or their per-32-column scales); not an `nnx.Param`, so the
  optimiser never sees it. Training needs the float table; FP8 storage is for evaluation and
  inference-sized memory."""


class Engram(nnx.Module):
  """Engram memory of layer `layer_id` (must be in cfg.engram_layer_ids)."""

  def __init__(self, cfg, layer_id: int, *, rngs: nnx.Rngs, fp8_table: bool = False):
    params = hashing.engram_hash_params(cfg, layer_id)
    self.layer_id = int(layer_id)
    self.eps = float(cfg.rms_norm_eps)
    self.dtype = jnp.dtype(cfg.dtype)
    self.fp8_table = bool(fp8_table)
    self.num_hash_heads = params.num_hash_heads
    self.num_rows = params.num_rows                           # rows a hash id can address
    self.num_rows_padded = lookup.padded_rows(params.num_rows)
    self.sub_table_sizes = tuple(int(p) for p in params.primes.reshape(-1))
    self.sub_table_offsets = tuple(int(o) for o in params.offsets.reshape(-1))
    n, d, de = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    rows_axes = ("engram_rows", "engram_dim")
    if fp8_table:
      if de % lookup.FP8_BLOCK:
        raise ValueError(f"fp8_table needs engram_head_dim ({de}) to be a multiple of "
                         f"{lookup.FP8_BLOCK}")
      full = sharding.normal(TABLE_INIT_STD)(rngs.params(), (self.num_rows_padded, de), jnp.float32)
      q, scale = jax.jit(lookup.quantize_fp8_rows)(full)
      self.table = FP8Table(q, logical_axes=rows_axes)
      self.table_scale = FP8Table(scale, logical_axes=rows_axes)
    else:
      self.table = sharding.param(rngs, (self.num_rows_padded, de), rows_axes,
                                  sharding.normal(TABLE_INIT_STD), pdt)
    self.w_ekv = sharding.param(rngs, (self.num_hash_heads * de, (n + 1) * d),
                                ("engram_in", "engram_out"), sharding.fan_in_normal((0,)), pdt)
    self.q_w = sharding.param(rngs, (n, d), ("hc", "norm"), sharding.constant(1.0), pdt)
    self.k_w = sharding.param(rngs, (n, d), ("hc", "norm"), sharding.constant(1.0), pdt)

  def rows(self, hash_ids_BxTxH: jax.Array) -> jax.Array:
    """Table rows [B, T, H, D_e] in the compute dtype (dequantised when the table is FP8)."""
    if self.fp8_table:
      # E4M3 values are exact in bfloat16/float16/float32: the collective moves them in self.dtype.
      q = lookup.engram_lookup(self.table[...], hash_ids_BxTxH, self.dtype)
      s = lookup.engram_lookup(self.table_scale[...], hash_ids_BxTxH, jnp.float32)
      return lookup.dequantize_fp8_rows(q, s).astype(self.dtype)
    return lookup.engram_lookup(self.table[...], hash_ids_BxTxH, self.dtype)

  def memory(self, hash_ids_BxTxH: jax.Array) -> jax.Array:
    """kv [B, T, (N+1)·d]: the looked-up rows projected to N stream keys and one value. It depends
    on the ids alone, so a scanned run computes it before its layers run."""
    B, T, H = hash_ids_BxTxH.shape
    if H != self.num_hash_heads:
      raise ValueError(f"Engram layer {self.layer_id} expects {self.num_hash_heads} hash ids per "
                       f"token, got {H}")
    e = self.rows(hash_ids_BxTxH.astype(jnp.int32)).reshape(B, T, -1)
    e = sharding.constrain(e, ("batch", "seq", "engram_in"))
    kv = jnp.einsum("bti,io->bto", e, self.w_ekv[...].astype(self.dtype))
    return sharding.constrain(kv, ("batch", "seq", "engram_out"))

  def inject(self, X_BxTxNxD: jax.Array, kv_BxTxO: jax.Array, token_mask_BxT: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """(X + α·v, mean gate per stream [N] over the masked tokens)."""
    w = self.q_w[...].astype(jnp.float32) * self.k_w[...].astype(jnp.float32)
    mask = token_mask_BxT.astype(bool)
    X_new, alpha = lookup.engram_inject(X_BxTxNxD, kv_BxTxO, w, mask, self.eps)
    return X_new, lookup.masked_mean(alpha, mask)

  def rows_touched(self, hash_ids_BxTxH: jax.Array, token_mask_BxT: jax.Array) -> jax.Array:
    """Distinct table rows read by the real tokens of a packed row, averaged over the rows that
    hold real tokens."""
    mask = token_mask_BxT.astype(bool)
    per_row = lookup.distinct_rows_per_row(hash_ids_BxTxH.astype(jnp.int32), mask)
    live = jnp.any(mask, axis=-1).astype(jnp.float32)
    return jnp.sum(per_row.astype(jnp.float32) * live) / jnp.maximum(jnp.sum(live), 1.0)

  def __call__(self, X_BxTxNxD: jax.Array, hash_ids_BxTxH: jax.Array,
               token_mask_BxT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(X_new [B, T, N, d], stats).

    stats: `gate_mean` [N], mean α per stream over real tokens; `rows_touched`, distinct table rows
    read by the real tokens of a packed row, averaged over the rows holding real tokens;
    `rows_touched_frac`, the same over num_rows. (Batch-wide coverage: `hashing.batch_rows_touched`
    on the host.)
    """
    X_new, gate = self.inject(X_BxTxNxD, self.memory(hash_ids_BxTxH), token_mask_BxT)
    touched = self.rows_touched(hash_ids_BxTxH, token_mask_BxT)
    return X_new, {"gate_mean": gate, "rows_touched": touched,
                   "rows_touched_frac": touched / self.num_rows}


def _abstract_state(cfg, layer_id: int) -> nnx.State:
  model = nnx.eval_shape(lambda: Engram(cfg, layer_id, rngs=nnx.Rngs(0)))
  return nnx.state(model, nnx.Param)


def engram_param_count(cfg) -> int:
  """Parameters of all Engram layers, from the modules' abstract shapes (tables incl. their
  < 1024 padding rows per layer, w_ekv, q_w, k_w)."""
  return sum(int(x.size) for l in cfg.engram_layer_ids
             for x in jax.tree.leaves(_abstract_state(cfg, l)))


def engram_table_param_count(cfg) -> int:
  """Parameters of the Engram tables alone (the 196.6B of docs/design.md §1 at full size)."""
  return sum(int(_abstract_state(cfg, l)["table"].size) for l in cfg.engram_layer_ids)
