"""Containers passed between CSA2 layers (docs/design.md §5): the shared compressed KV and its top-k."""

from __future__ import annotations

from typing import NamedTuple

import jax

from pallas_kernels.ops import indexer as ops_indexer


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
  """Bool [B, T, N]: entry visible to query (the op `pallas_kernels.ops.indexer.entry_visible`
  on the entries' metadata; docs/design.md §5.2 causality + §14)."""
  return ops_indexer.entry_visible(kv.entry_segment_BxN, kv.entry_last_BxN, segment_ids_BxT,
                                   query_rows_T)
