"""Containers passed between CSA2 layers (docs/design.md §5): the shared compressed KV and its top-k."""

from __future__ import annotations

from typing import NamedTuple

import jax


class CompressedKV(NamedTuple):
  """What a CSA2 Full layer publishes for the layers that share it (docs/design.md §5.2–5.3, §14).

  N = ⌈T / m⌉ entries per row; entry g pools tokens [g·m, (g+1)·m).
  """

  main_kv_BxNxD: jax.Array      # RMSNorm'd pooled latent, trailing rope dims rotated at pos g·m
  index_k_BxNxI: jax.Array      # indexer key from the pre-RoPE latent (RoPE'd, optionally FP4)
  entry_segment_BxN: jax.Array  # int32: the document of the group, or -1 if the group straddles a
                                # boundary, holds padding, or is incomplete at the row's end
  entry_last_BxN: jax.Array     # int32: row index of the group's last token, (g+1)·m − 1
  entry_pos_BxN: jax.Array      # int32: `position` of the group's first token


def entry_visible(kv: CompressedKV, segment_ids_BxT: jax.Array,
                  query_rows_T: jax.Array | None = None) -> jax.Array:
  """Bool [B, T, N]: compressed entry g is visible to query t (docs/design.md §5.2 causality + §14).

  Visible iff the group is complete by t, (g+1)·m − 1 ≤ t, and all of its tokens lie in t's
  document (padding, segment 0, sees nothing). `query_rows_T` gives the row index of each query
  when the queries are a chunk of the row (default: rows 0 … T−1).
  """
  import jax.numpy as jnp
  t = (jnp.arange(segment_ids_BxT.shape[1], dtype=jnp.int32) if query_rows_T is None
       else query_rows_T.astype(jnp.int32))
  complete = kv.entry_last_BxN[:, None, :] <= t[None, :, None]
  same_doc = kv.entry_segment_BxN[:, None, :] == segment_ids_BxT[:, :, None]
  return complete & same_doc & (segment_ids_BxT[:, :, None] > 0)
