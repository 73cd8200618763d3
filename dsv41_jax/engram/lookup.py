"""Engram table lookup, gate and injection as pure functions (docs/design.md §7.3, V4.1 form).

The table of one Engram layer holds all (order, head) sub-tables concatenated by row offset. Its
rows are split over the mesh axes of the logical axis "engram_rows" (`sharding.RULES`: `engram`
and the batch axes, so every device owns distinct rows, §7.4 "engram-parallel"), in contiguous
blocks: device g of that group (linear index over the axes in rule order) owns rows
[g·R/G, (g+1)·R/G).

`engram_lookup` is a row exchange with the owners inside one `shard_map`, per device:
  ids [n = b·T·H] → unique sorted ids u (dedup: a row is asked for once however often it repeats)
  → owner(u) = u // (R/G), rank within its owner → rounds of at most C ids per owner:
     send ids [G, C] ─all_to_all→ owners gather their rows [G, C, D] ─all_to_all→ back
  → rows of u [n, D] → rows[inverse] [b, T, H, D].
C = ceil(EXCHANGE_FACTOR · n / G) (an owner's expected share of the ids, with slack for the
hash's unevenness); the number of rounds, ceil(max ids any device sends one owner / C), is
agreed with a `pmax` over the group, so the exchange is exact for any ids (repeated or
adversarial ones only cost more rounds) and its buffers stay O(n·D) per device at any G.

Backward (a custom VJP, "Engram gradients as rows"): the float32 row gradients of the unique ids
(a segment sum over the inverse) travel the same rounds to their owners as (row id, row
gradient) pairs, and each owner scatter-adds them into its own rows. The table gradient is
therefore sharded exactly like the table; nothing table-shaped is formed beyond the owner's
shard, and no collective moves a table-sized buffer. Of the devices that hold the same ids
(replicas over an axis that does not split the batch) one sends; a table replicated over an axis
outside the row group (`tensor`) has its shard's gradient summed over that axis by shard_map's
transpose (a shard-sized all-reduce: keep `tensor` out of such meshes or in the row rule).

Without a mesh the gather runs locally (its transpose is the same scatter-add into one table).

Gate (per token and mHC stream i, ε = rms_norm_eps):
  dot_i = Σ_d X_i,d·w_i,d·k_i,d · rsqrt(mean_d X_i² + ε) · rsqrt(mean_d k_i² + ε) · d^{-1/2}
  α_i   = sigmoid(sign(dot_i) · sqrt(max(|dot_i|, 1e-6)))        w = q_w ⊙ k_w
  X_i  ← X_i + α_i · v                  (α_i = 0 where the token mask is False)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dsv41_jax import quant, sharding
from pallas_kernels.ops import quant as ops_quant

# Table rows are padded to a multiple of this, so they split evenly over any power-of-two row
# group up to this size. Padded rows are never addressed by a hash id.
ROW_PAD_MULTIPLE = 1024
FP8_BLOCK = quant.FP8_SWA_BLOCK   # columns per FP8 scale (docs/design.md §1: one scale per 32 columns)
# Per-owner slots of one exchange round, as a multiple of an owner's mean share n / G. With
# hashed rows a device's distinct ids spread over owners nearly uniformly (binomial: at Flash
# size, n = 98,304 ids over G = 512 owners, mean 192, σ ≈ 14), so 2× the mean makes one round
# the rule; more rounds are exact, only slower.
EXCHANGE_FACTOR = 2.0


def padded_rows(num_rows: int, multiple: int = ROW_PAD_MULTIPLE) -> int:
  return -(-int(num_rows) // multiple) * multiple


def _gather_owned(table_RxD: jax.Array, ids: jax.Array, row_start) -> jax.Array:
  """Rows `ids − row_start` of a table slice; ids the slice does not own give zero rows."""
  rows = table_RxD.shape[0]
  local = ids - row_start
  local = jnp.where((local >= 0) & (local < rows), local, rows)
  return table_RxD.at[local].get(mode="fill", fill_value=0)


def exchange_capacity(n_ids: int, n_owners: int, factor: float = EXCHANGE_FACTOR) -> int:
  """Slots per owner per round, C = min(n, ceil(factor · n / G))."""
  return int(max(1, min(n_ids, math.ceil(factor * n_ids / n_owners))))


class _Plan:
  """Where each unique id of one device goes: owner, rank among that owner's ids, rounds."""

  def __init__(self, ids_n, rows_local: int, n_owners: int, capacity: int, row_axes):
    n = ids_n.shape[0]
    sentinel = rows_local * n_owners            # sorts last, owner == n_owners: never sent
    u, inv = jnp.unique(ids_n, size=n, fill_value=sentinel, return_inverse=True)
    self.inv = inv.reshape(-1)
    self.owner = jnp.minimum(u // rows_local, n_owners)
    self.row = u - self.owner * rows_local       # row within the owner's block
    cnt = jnp.zeros((n_owners + 1,), jnp.int32).at[self.owner].add(1)[:n_owners]
    start = jnp.cumsum(cnt) - cnt
    self.rank = jnp.arange(n) - jnp.concatenate([start, jnp.array([n], jnp.int32)])[self.owner]
    self.live = self.owner < n_owners
    most = jax.lax.pmax(jnp.max(cnt), row_axes)
    self.rounds = (most + capacity - 1) // capacity
    self.n_owners, self.capacity, self.row_axes = n_owners, capacity, row_axes

  @classmethod
  def restore(cls, inv, owner, row, rank, rounds, *, sender, n_owners, capacity, row_axes):
    """The plan of the forward pass, from its residuals; only a `sender` device sends."""
    plan = object.__new__(cls)
    plan.inv, plan.owner, plan.row, plan.rank, plan.rounds = inv, owner, row, rank, rounds
    plan.live = (owner < n_owners) & sender
    plan.n_owners, plan.capacity, plan.row_axes = n_owners, capacity, row_axes
    return plan

  def slot(self, r):
    """(in this round, flat slot owner·C + rank − r·C) of every unique id."""
    pos = self.rank - r * self.capacity
    now = self.live & (pos >= 0) & (pos < self.capacity)
    return now, jnp.where(now, self.owner * self.capacity + pos, self.n_owners * self.capacity)

  def send(self, now_slot, values, fill):
    """[G, C, ...] buffer of `values` at their slots (`fill` elsewhere), exchanged with owners."""
    buf = jnp.full((self.n_owners * self.capacity,) + values.shape[1:], fill, values.dtype)
    buf = buf.at[now_slot].set(values, mode="drop")
    buf = buf.reshape((self.n_owners, self.capacity) + values.shape[1:])
    return jax.lax.all_to_all(buf, self.row_axes, 0, 0, tiled=True)


def _exchange_lookup(table_local, ids_n, *, n_owners, capacity, row_axes, dtype):
  """(rows of ids_n [n, D] in float32, via the owners) and the plan, for the backward."""
  rows_local, d = table_local.shape
  plan = _Plan(ids_n, rows_local, n_owners, capacity, row_axes)

  def one_round(r, acc):
    now, slot = plan.slot(r)
    recv = plan.send(slot, plan.row, -1).reshape(-1)                     # ids others ask of me
    got = table_local.at[jnp.where(recv >= 0, recv, rows_local)].get(mode="fill", fill_value=0)
    got = got.astype(dtype).reshape(n_owners, capacity, d)
    back = jax.lax.all_to_all(got, row_axes, 0, 0, tiled=True).reshape(-1, d)
    mine = jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])[slot]
    return acc + jnp.where(now[:, None], mine.astype(jnp.float32), 0.0)

  rows_u = jax.lax.fori_loop(0, plan.rounds, one_round,
                             jnp.zeros((ids_n.shape[0], d), jnp.float32))
  return rows_u[plan.inv], plan


def _exchange_grad(g_nxD, plan, rows_local, table_dtype):
  """Row gradients of the unique ids (float32 sums over repeats), sent to their owners in float32
  and scatter-added there."""
  n, d = g_nxD.shape
  g_u = jax.ops.segment_sum(g_nxD.astype(jnp.float32), plan.inv, num_segments=n)

  def one_round(r, acc):
    now, slot = plan.slot(r)
    recv_id = plan.send(slot, jnp.where(now, plan.row, -1), -1).reshape(-1)
    recv_g = plan.send(slot, g_u, 0).reshape(-1, d)
    at = jnp.where(recv_id >= 0, recv_id, rows_local)
    return acc.at[at].add(recv_g, mode="drop")

  g_tab = jax.lax.fori_loop(0, plan.rounds, one_round, jnp.zeros((rows_local, d), jnp.float32))
  return g_tab.astype(table_dtype)


def _row_group(mesh, n_rows: int):
  """The mesh axes the rows split over (present in the mesh, any size) and their product."""
  axes = tuple(a for a in sharding.mesh_axes(mesh, "engram_rows", min_size=1))
  g = sharding.axes_size(mesh, axes)
  if n_rows % g:
    raise sharding.ShardingError(
        f"Engram table rows ({n_rows}) do not split over the mesh axes {axes} of 'engram_rows' "
        f"({g} ways); pad the rows (padded_rows) or change the mesh")
  return axes, g


def _ids_axes(mesh, batch: int) -> tuple[str, ...]:
  """Batch mesh axes (size > 1) whose product divides `batch`, dropping from the end."""
  axes = sharding.batch_axes(mesh)
  while axes and batch % sharding.axes_size(mesh, axes):
    axes = axes[:-1]
  return axes


def engram_lookup(table_RxD: jax.Array, ids: jax.Array, dtype=None) -> jax.Array:
  """table[ids].astype(dtype), shape ids.shape + (D,), ids leading with the batch axis.

  With a mesh in context: the row exchange of the module docstring (the table split over the
  "engram_rows" mesh axes, ids over the batch axes that divide the batch). The rows travel in
  `dtype` (e.g. bfloat16: exact, it is the output's dtype); the row gradients, summed over
  repeats, in float32 (what the local scatter-add accumulates, no extra rounding). Without a mesh:
  a local gather.
  """
  dtype = table_RxD.dtype if dtype is None else jnp.dtype(dtype)
  mesh = sharding.context_mesh()
  if mesh is None:
    return _gather_owned(table_RxD, ids, 0).astype(dtype)
  row_axes, n_owners = _row_group(mesh, table_RxD.shape[0])
  if not row_axes:
    return _gather_owned(table_RxD, ids, 0).astype(dtype)
  id_axes = _ids_axes(mesh, ids.shape[0])
  n = math.prod(ids.shape) // sharding.axes_size(mesh, id_axes)
  rows_local, table_dtype = table_RxD.shape[0] // n_owners, table_RxD.dtype
  kw = dict(n_owners=n_owners, capacity=exchange_capacity(n, n_owners), row_axes=row_axes)
  # Devices holding the same ids: the replicas over every mesh axis that does not split them.
  # shard_map's transpose hands each replica 1/copies of the output cotangent; the first replica
  # sends copies × its share (exact for power-of-two meshes) and the others nothing, so a row's
  # gradient is summed in the same order as the local scatter-add.
  dup_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in id_axes)
  copies = sharding.axes_size(mesh, dup_axes)
  spec = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else axes)

  @jax.custom_vjp
  def local(table_local, ids_local):
    return _exchange_lookup(table_local, ids_local.reshape(-1), dtype=dtype, **kw)[0]

  def fwd(table_local, ids_local):
    rows, plan = _exchange_lookup(table_local, ids_local.reshape(-1), dtype=dtype, **kw)
    return rows, (plan.inv, plan.owner, plan.row, plan.rank, plan.rounds, ids_local)

  def bwd(res, g):
    *parts, ids_local = res
    sender = jnp.bool_(True)
    for a in dup_axes:
      sender = sender & (jax.lax.axis_index(a) == 0)
    plan = _Plan.restore(*parts, sender=sender, **kw)
    g_tab = _exchange_grad(g * copies, plan, rows_local, table_dtype)
    return g_tab, np.zeros(ids_local.shape, jax.dtypes.float0)

  local.defvjp(fwd, bwd)

  def body(table_local, ids_local):
    out = local(table_local, ids_local)
    return out.astype(dtype).reshape(ids_local.shape + (table_local.shape[1],))

  ids_spec = P(spec(id_axes))
  return jax.shard_map(body, mesh=mesh, in_specs=(P(spec(row_axes), None), ids_spec),
                       out_specs=ids_spec, check_vma=False)(table_RxD, ids)


# --- FP8 storage (E4M3 values, one power-of-two scale per 32 columns) ---------------------------

def quantize_fp8_rows(x_RxD: jax.Array, block: int = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
  """(q float8_e4m3fn [R, D], scale float32 [R, D/block]) with x ≈ q · scale blockwise.

  The FP8 block format of docs/design.md §9.2 (the SWA-KV rule of `quant.fp8_swa`, stored instead of
  fake-quantised): scale = 2^⌈log2(max(amax, 1e-4) / 448)⌉ per block, so nothing clips.
  """
  R, D = x_RxD.shape
  if D % block:
    raise ValueError(f"FP8 rows need the width ({D}) to be a multiple of {block}")
  xb = x_RxD.astype(jnp.float32).reshape(R, D // block, block)
  amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), 1e-4)
  scale = ops_quant._ceil_pow2(amax / quant.E4M3_MAX)
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
  # Added in float32, rounded once to the streams' dtype (the same bits for float32 streams).
  return (x_BxTxNxD.astype(jnp.float32) + update).astype(x_BxTxNxD.dtype), alpha


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
