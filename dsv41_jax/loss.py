"""Training objective over packed rows: LM cross-entropy plus the auxiliary losses (docs/design.md §5.5, §8.4).

    loss = LM + balance_loss_weight · Σ_layers L_bal + indexer_loss_weight · Σ_layers L^I

The sequence-wise balance loss is a per-MoE-layer term (§8.4: α = 1e-4 for each layer's L_bal), so
the layers are summed, not averaged: at Flash depth a mean would weight each layer 1e-4/40.

The indexer loss only reaches indexer parameters (its inputs are detached, §5.5) and the LM loss
never reaches them (top-k is not differentiable), so one scalar trains both without interference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """Mean next-token cross-entropy (nats) over positions where `mask` is true, and their count."""
  logits = logits_BxTxV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]
  mask = mask_BxT.astype(jnp.float32)
  n = mask.sum()
  return ((lse - picked) * mask).sum() / jnp.maximum(n, 1.0), n


def objective(cfg: ModelConfig, logits_BxTxV: jax.Array, aux: dict[str, jax.Array],
              batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
  lm, n_tokens = cross_entropy(logits_BxTxV, batch["targets"], batch["loss_mask"])
  balance = aux["balance_loss"].sum()                      # one α-weighted term per MoE layer
  indexer = aux["indexer_loss"].sum()
  total = lm + cfg.balance_loss_weight * balance + cfg.indexer_loss_weight * indexer
  return total, {"lm_loss": lm, "balance_loss": balance, "indexer_loss": indexer,
                 "loss_tokens": n_tokens}
