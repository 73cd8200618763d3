"""Training objective (dsv41_jax/loss.py) against a float64 numpy restatement."""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.loss import objective

B, T, V, L = 2, 5, 11, 3


def _np_objective(logits, targets, mask, balance_L, indexer_L, w_bal, w_idx):
  """LM cross-entropy over masked positions + α·L_bal for EACH MoE layer (§8.4) + Σ L^I."""
  x = logits.astype(np.float64)
  lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
  nll = lse - np.take_along_axis(x, targets[..., None], -1)[..., 0]
  lm = (nll * mask).sum() / mask.sum()
  return lm + sum(w_bal * b for b in balance_L) + w_idx * indexer_L.astype(np.float64).sum()


def test_objective_weights_every_moe_layer_balance_loss():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(B, T, V)).astype(np.float32) * 2
  targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
  mask = rng.random((B, T)) < 0.7
  mask[0, 0] = True
  balance = (1 + rng.random(L)).astype(np.float32)
  indexer = rng.random(L).astype(np.float32)
  cfg = ModelConfig(balance_loss_weight=0.3, indexer_loss_weight=0.7)
  batch = dict(targets=jnp.asarray(targets), loss_mask=jnp.asarray(mask))

  def total(bal):
    aux = dict(balance_loss=bal, indexer_loss=jnp.asarray(indexer))
    return objective(cfg, jnp.asarray(logits), aux, batch)[0]

  got, d_bal = jax.value_and_grad(total)(jnp.asarray(balance))
  want = _np_objective(logits, targets, mask, balance, indexer, 0.3, 0.7)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  # each layer's balance loss enters with the full weight α, not α / n_layers
  np.testing.assert_array_equal(np.asarray(d_bal), np.full(L, 0.3, np.float32))
