"""Engram table lookup, gate and injection as pure functions (MODEL.md §7.3, V4.1 form).

The table of one Engram layer holds all (order, head) sub-tables concatenated by row offset and is
row-partitioned over the mesh's `engram` axis ("engram-parallel", §7.4). `engram_lookup` runs in a
`shard_map`: every shard sees all row ids of its engram group, gathers the rows it owns (zeros for
the others) and the partial results are summed over the axis (reduce-scatter back onto the batch
sharding, or `psum`). The gradient is the gather's own transpose, a row scatter-add into the owning
shard; no dense one-hot over rows is formed.

Gate (per token and mHC stream i, ε = rms_norm_eps):
  dot_i = Σ_d X_i,d·w_i,d·k_i,d · rsqrt(mean_d X_i² + ε) · rsqrt(mean_d k_i² + ε) · d^{-1/2}
  α_i   = sigmoid(sign(dot_i) · sqrt(max(|dot_i|, 1e-6)))        w = q_w ⊙ k_w
  X_i  ← X_i + α_i · v                  (α_i = 0 where the token mask is False)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv41_jax import quant, sharding

ENGRAM_AXIS = "engram"
# Table rows are padded to a multiple of this, so they split evenly over any power-of-two engram
# axis up to this size. Padded rows are never addressed by a hash id.
ROW_PAD_MULTIPLE = 1024
FP8_BLOCK = quant.FP8_SWA_BLOCK   # columns per FP8 scale (MODEL.md §1: one scale per 32 columns)


def padded_rows(num_rows: int, multiple: int = ROW_PAD_MULTIPLE) -> int:
  return -(-int(num_rows) // multiple) * multiple


def _gather_owned(table_RxD: jax.Array, ids: jax.Array, row_start) -> jax.Array:
  """Rows `ids − row_start` of a table slice; ids the slice does not own give zero rows.

  Unowned ids are sent out of range and filled with zeros, so the transpose (a scatter-add in
  'drop' mode) touches only owned rows.
  """
  rows = table_RxD.shape[0]
  local = ids - row_start
  local = jnp.where((local >= 0) & (local < rows), local, rows)
  return table_RxD.at[local].get(mode="fill", fill_value=0)


def _batch_axes(mesh, batch: int) -> tuple[str, ...]:
  """Mesh axes (size > 1) splitting the batch under the "batch" rule, if together they divide it."""
  entry = sharding.RULES["batch"]
  names = (entry,) if isinstance(entry, str) else tuple(entry or ())
  axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return axes if axes and batch % size == 0 else ()


def engram_lookup(table_RxD: jax.Array, ids: jax.Array, dtype=None) -> jax.Array:
  """table[ids].astype(dtype), shape ids.shape + (D,); row-sharded over `engram` if present.

  Without a mesh in context, or with an `engram` axis of size 1, the gather runs locally. With one,
  the table must be split over `engram` on its rows (logical axis "engram_rows"; the row count
  divides by the axis size, see `padded_rows`) and ids lead with the batch axis:
  - batch split over `engram` (the "batch" rule, when it divides the batch): each device's ids are
    all-gathered over its engram group, every shard gathers the rows it owns, and a reduce-scatter
    (`psum_scatter`) returns each token's rows to the device that holds the token;
  - otherwise (ids replicated over `engram`): every shard gathers its rows and `psum` sums them.
  Exactly one shard contributes a non-zero to each output element, so casting to `dtype` (e.g.
  bfloat16) before the collective is exact and halves its bytes.
  """
  dtype = table_RxD.dtype if dtype is None else jnp.dtype(dtype)
  mesh = jax.sharding.get_abstract_mesh()
  n_shards = 1
  if mesh is not None and not mesh.empty and ENGRAM_AXIS in mesh.axis_names:
    n_shards = int(mesh.shape[ENGRAM_AXIS])
  if n_shards == 1:
    return _gather_owned(table_RxD, ids, 0).astype(dtype)
  if table_RxD.shape[0] % n_shards:
    raise ValueError(f"table rows ({table_RxD.shape[0]}) do not split over the {n_shards} "
                     f"shards of the '{ENGRAM_AXIS}' mesh axis")
  batch_axes = _batch_axes(mesh, ids.shape[0])
  scatter_back = ENGRAM_AXIS in batch_axes

  def shard(table_local, ids_local):
    start = jax.lax.axis_index(ENGRAM_AXIS) * table_local.shape[0]
    if scatter_back:
      ids_group = jax.lax.all_gather(ids_local, ENGRAM_AXIS, axis=0, tiled=True)
      rows = _gather_owned(table_local, ids_group, start).astype(dtype)
      return jax.lax.psum_scatter(rows, ENGRAM_AXIS, scatter_dimension=0, tiled=True)
    return jax.lax.psum(_gather_owned(table_local, ids_local, start).astype(dtype), ENGRAM_AXIS)

  ids_spec = P(batch_axes) if batch_axes else P()
  return jax.shard_map(shard, in_specs=(P(ENGRAM_AXIS, None), ids_spec), out_specs=ids_spec)(
      table_RxD, ids)


# --- FP8 storage (E4M3 values, one power-of-two scale per 32 columns) ---------------------------

def quantize_fp8_rows(x_RxD: jax.Array, block: int = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
  """(q float8_e4m3fn [R, D], scale float32 [R, D/block]) with x ≈ q · scale blockwise.

  The FP8 block format of MODEL.md §9.2 (the SWA-KV rule of `quant.fp8_swa`, stored instead of
  fake-quantised): scale = 2^⌈log2(max(amax, 1e-4) / 448)⌉ per block, so nothing clips.
  """
  R, D = x_RxD.shape
  if D % block:
    raise ValueError(f"FP8 rows need the width ({D}) to be a multiple of {block}")
  xb = x_RxD.astype(jnp.float32).reshape(R, D // block, block)
  amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), 1e-4)
  scale = quant._ceil_pow2(amax / quant.E4M3_MAX)
  q = jnp.clip(xb / scale[..., None], -quant.E4M3_MAX, quant.E4M3_MAX)
  q = q.astype(jnp.float8_e4m3fn).reshape(R, D)
  return q, scale


def dequantize_fp8_rows(q_XxD: jax.Array, scale_XxS: jax.Array) -> jax.Array:
  """float32 rows q · scale, each scale applied to its block of D / S columns."""
  *lead, D = q_XxD.shape
  S = scale_XxS.shape[-1]
  x = q_XxD.astype(jnp.float32).reshape(*lead, S, D // S) * scale_XxS[..., None]
  return x.reshape(*lead, D)


# --- gate and injection ------------------------------------------------------------------------

def engram_gate(x_BxTxNxD: jax.Array, k_BxTxNxD: jax.Array, w_NxD: jax.Array,
                eps: float) -> jax.Array:
  """α [B, T, N] in float32 (formula in the module docstring); w = q_w ⊙ k_w."""
  x = x_BxTxNxD.astype(jnp.float32)
  k = k_BxTxNxD.astype(jnp.float32)
  d = x.shape[-1]
  raw = jnp.einsum("btnd,nd,btnd->btn", x, w_NxD.astype(jnp.float32), k)
  dot = (raw * jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)
         * jax.lax.rsqrt(jnp.mean(k * k, axis=-1) + eps) * d ** -0.5)
  return jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))


def engram_inject(x_BxTxNxD: jax.Array, kv_BxTxO: jax.Array, w_NxD: jax.Array,
                  token_mask_BxT: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
  """(X + α·v, α): split kv into N stream keys and the shared value, gate, add.

  kv_BxTxO has O = (N + 1)·D: keys k_i = kv[i·D:(i+1)·D], value v = kv[N·D:].
  """
  B, T, N, D = x_BxTxNxD.shape
  if kv_BxTxO.shape[-1] != (N + 1) * D:
    raise ValueError(f"kv width {kv_BxTxO.shape[-1]} is not (hc_mult + 1)·hidden = {(N + 1) * D}")
  k = kv_BxTxO[..., :N * D].reshape(B, T, N, D)
  v = kv_BxTxO[..., N * D:]
  alpha = engram_gate(x_BxTxNxD, k, w_NxD, eps) * token_mask_BxT[..., None].astype(jnp.float32)
  update = alpha[..., None] * v[:, :, None, :].astype(jnp.float32)
  return x_BxTxNxD + update.astype(x_BxTxNxD.dtype), alpha


# --- statistics --------------------------------------------------------------------------------

def masked_mean(x_BxTxN: jax.Array, token_mask_BxT: jax.Array) -> jax.Array:
  """[N]: mean of x over the tokens whose mask is True (0 if there are none)."""
  m = token_mask_BxT.astype(jnp.float32)
  return jnp.einsum("btn,bt->n", x_BxTxN.astype(jnp.float32), m) / jnp.maximum(m.sum(), 1.0)


def distinct_rows_per_row(ids_BxTxH: jax.Array, token_mask_BxT: jax.Array) -> jax.Array:
  """int32 [B]: distinct table rows read by the real tokens of each packed row (sort, count first
  occurrences).

  Counted per row, not over the whole batch: the sort then runs along an unsharded axis, while a
  batch-wide count would gather every row id of the global batch onto every device. The exact
  batch-wide count is a host computation on the same ids (`hashing.batch_rows_touched`).
  """
  B = ids_BxTxH.shape[0]
  s = jnp.sort(jnp.where(token_mask_BxT[..., None], ids_BxTxH, -1).reshape(B, -1), axis=-1)
  first = jnp.concatenate([jnp.ones((B, 1), bool), s[:, 1:] != s[:, :-1]], axis=-1)
  return jnp.sum(first & (s >= 0), axis=-1, dtype=jnp.int32)
