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


def _np_head_loss_and_grads(h, w, targets, mask):
  """float64: mean masked NLL of logits h·W and its gradients w.r.t. h and W."""
  h64, w64 = h.astype(np.float64), w.astype(np.float64)
  x = h64 @ w64
  p = np.exp(x - x.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
  nll = lse - np.take_along_axis(x, targets[..., None], -1)[..., 0]
  n = mask.sum()
  d_x = (p - np.eye(w.shape[1])[targets]) * (mask / n)[..., None]
  return (nll * mask).sum() / n, d_x @ w64.T, np.einsum("btd,btv->dv", h64, d_x)


def test_head_cross_entropy_in_chunks_equals_float64_logits():
  """Loss and both gradients of the chunked head loss against float64 full logits: float32
  compute to float32 rounding, with a chunk that does not divide the tokens (13 = 2 × 5 + 3
  padding tokens, weight 0) and masked positions; in bfloat16 compute within the rounding of h,
  W and the logits' cotangent to bfloat16 (8 bits: 2⁻⁸ relative per term)."""
  from dsv41_jax.loss import cross_entropy, head_cross_entropy
  rng = np.random.default_rng(3)
  Bh, Th, D, Vh = 1, 13, 8, 37
  h = rng.normal(size=(Bh, Th, D)).astype(np.float32)
  w = rng.normal(size=(D, Vh)).astype(np.float32) * 0.5
  targets = rng.integers(0, Vh, size=(Bh, Th)).astype(np.int32)
  mask = rng.random((Bh, Th)) < 0.7
  want, want_dh, want_dw = _np_head_loss_and_grads(h, w, targets, mask.astype(np.float64))

  def loss(h, w, chunk, dtype):
    return head_cross_entropy(h.astype(dtype), w, targets, mask, chunk)[0]

  for chunk in (5, 13, 64):
    got, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w, chunk, jnp.float32)
    np.testing.assert_allclose(float(got), want, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(dh), want_dh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-6)
  n_tok = head_cross_entropy(h, w, targets, mask, 5)[1]
  assert float(n_tok) == mask.sum()
  plain = cross_entropy(jnp.einsum("btd,dv->btv", h, w), targets, mask)[0]
  np.testing.assert_allclose(float(head_cross_entropy(h, w, targets, mask, 5)[0]), float(plain),
                             rtol=1e-6)

  got, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w, 5, jnp.bfloat16)
  hb = np.asarray(jnp.asarray(h).astype(jnp.bfloat16).astype(jnp.float32))
  wb = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))
  want_b, want_dhb, want_dwb = _np_head_loss_and_grads(hb, wb, targets, mask.astype(np.float64))
  assert dw.dtype == jnp.float32   # accumulated over chunks in float32, not rounded to bf16
  np.testing.assert_allclose(float(got), want_b, rtol=1e-6)
  scale_h, scale_w = np.abs(want_dhb).max(), np.abs(want_dwb).max()
  # each gradient element sums V (d_h) or tokens (d_W) terms, each rounded once to bf16, plus
  # the bf16 rounding of d_h itself
  assert np.abs(np.asarray(dh, np.float64) - want_dhb).max() <= 2 * 2.0 ** -8 * scale_h
  assert np.abs(np.asarray(dw, np.float64) - want_dwb).max() <= 2.0 ** -8 * scale_w


def test_batch_counts_against_a_loop():
  """`batch_counts` (the units of every mean, for micro-batch shares) against plain loops over a
  packed batch with padding, several documents per row and image placeholders."""
  from dsv41_jax import testing
  from dsv41_jax.layer_plan import build_layer_plan
  from dsv41_jax.loss import batch_counts
  cfg = testing.tiny_config()
  batch = testing.packed_batch(cfg, 5, batch_size=3, max_docs=4, image_spans=[1, 0, 2],
                               pad_from=[None, 11, 25])
  got = jax.tree.map(np.asarray, batch_counts(cfg, {k: jnp.asarray(v) for k, v in batch.items()
                                                    if k != "engram_ids"}))
  seg, image = batch["segment_ids"], batch["image_mask"]
  n_rows, n_t = seg.shape
  docs = sum(1 for b in range(n_rows) for t in range(n_t)
             if seg[b, t] and (t == 0 or seg[b, t] != seg[b, t - 1]))

  def sees_an_entry(b, t, m):   # a complete group of m tokens, all in t's document, ending by t
    return any(all(seg[b, g * m + i] == seg[b, t] for i in range(m)) for g in range((t + 1) // m))

  want_idx = []
  for spec in build_layer_plan(cfg):
    m = spec.compress_ratio
    want_idx.append(0 if not (spec.reads_global_kv and spec.owns_indexer) else sum(
        1 for b in range(n_rows) for t in range(n_t) if seg[b, t] and sees_an_entry(b, t, m)))
  text = (seg > 0) & ~image
  assert got["lm"] == batch["loss_mask"].sum() and got["balance"] == docs
  np.testing.assert_array_equal(got["indexer"], want_idx)
  assert sorted(set(want_idx)) != [0] and len(set(want_idx) - {0}) == 2   # ratios 2 and 1 differ
  assert got["moe"] == (seg > 0).sum() and got["engram"] == text.sum()
  assert got["engram_rows"] == text.any(1).sum()


def test_head_loss_makes_its_logits_once_a_step():
  """The loss and its gradients from one product for the logits: the differentiated program holds
  three products of the head (the logits, d_h, d_W; the backward only scales the forward's
  gradients by the cotangent), the value alone one. A backward that made the logits again (four
  products: a fourth [N, D, V] GEMM and a float32 write and read of the logits) fails."""
  from dsv41_jax.loss import head_cross_entropy
  rng = np.random.default_rng(4)
  h = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 40, size=(2, 8)), jnp.int32)
  mask = jnp.ones((2, 8), bool)

  def loss(h, w):
    return head_cross_entropy(h, w, targets, mask, 8)[0]

  def products(f):
    return jax.jit(f).lower(h, w).as_text().count("dot_general")

  assert products(loss) == 1
  assert products(jax.value_and_grad(loss, argnums=(0, 1))) == 3
