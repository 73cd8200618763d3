"""Training objective over packed rows: LM cross-entropy plus the auxiliary losses (docs/design.md §5.5, §8.4).

    loss = LM + balance_loss_weight · Σ_layers L_bal + indexer_loss_weight · Σ_layers L^I

The sequence-wise balance loss is a per-MoE-layer term (§8.4: α = 1e-4 for each layer's L_bal), so
the layers are summed, not averaged: at Flash depth a mean would weight each layer 1e-4/40.

The indexer loss only reaches indexer parameters (its inputs are detached, §5.5) and the LM loss
never reaches them (top-k is not differentiable), so one scalar trains both without interference.

`head_cross_entropy` is the same LM cross-entropy computed from the final hidden state and the head
in chunks of tokens (`ModelConfig.lm_loss_chunk`), so the float32 [B, T, V] logits never exist
for the whole batch: each chunk's logits are made, reduced and dropped. Under differentiation
(a hand-written VJP) the same pass also makes the gradients for a unit cotangent, the logits'
cotangent rounded to the compute dtype before the two products (bf16 tensor-core GEMMs on a
GPU, not float32 ones), and the backward only scales them: the logits are made once a step.

Micro-batches (gradient accumulation, docs/design.md §T2). Every term is a mean over its own
units: the LM loss over loss tokens, each layer's balance loss over documents, each layer's
indexer loss over the real tokens that see a compressed entry. `batch_counts` counts those units
(and the units of the logged means) from the batch alone, so before a step each micro-batch's
share of the whole batch is known; `objective(..., share=...)` weights each term by it, and the
weighted objectives (and their gradients) of the micro-batches sum to the whole batch's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers.compressor import entry_metadata
from dsv41_jax.layers.moe import document_starts
from dsv41_jax.layers.types import CompressedKV, entry_visible


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """Mean next-token cross-entropy (nats) over positions where `mask` is true, and their count."""
  logits = logits_BxTxV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]
  mask = mask_BxT.astype(jnp.float32)
  n = mask.sum()
  return ((lse - picked) * mask).sum() / jnp.maximum(n, 1.0), n


def _chunks(x_NxK: jax.Array, chunk: int) -> jax.Array:
  n = x_NxK.shape[0]
  pad = -n % chunk
  x = jnp.pad(x_NxK, ((0, pad),) + ((0, 0),) * (x_NxK.ndim - 1))
  return x.reshape((n + pad) // chunk, chunk, *x_NxK.shape[1:])


def _chunk_logits(h_CxD, head_DxV):
  return jnp.einsum("cd,dv->cv", h_CxD, head_DxV.astype(h_CxD.dtype),
                    preferred_element_type=jnp.float32)


def _chunk_nll(h_CxD, head_DxV, t_C, w_C):
  """A chunk's logits [C, V] float32, its log-sum-exps and Σ_c w_c · NLL_c."""
  logits = _chunk_logits(h_CxD, head_DxV)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, t_C[:, None], axis=-1)[:, 0]
  return logits, lse, ((lse - picked) * w_C).sum()


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _head_nll_sum(h_NxD, head_DxV, targets_N, weight_N, chunk):
  """Σ_n weight_n · (logsumexp(h_n·W) − (h_n·W)[target_n]), chunk tokens at a time."""
  def body(total, c):
    h, t, w = c
    return total + _chunk_nll(h, head_DxV, t, w)[2], None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (_chunks(h_NxD, chunk), _chunks(targets_N, chunk),
                           _chunks(weight_N, chunk)))
  return total


def _head_nll_fwd(h_NxD, head_DxV, targets_N, weight_N, chunk):
  """The value and, from the same logits, the gradients for a unit cotangent: the loss is a
  scalar, so its backward only scales them (g · d_h, g · d_W). Each chunk's [C, V] logits are
  made once a step, not again in the backward: one of the head's four [N, D, V] products and a
  float32 write and read of the logits fewer (m3 at 4 × 4096: 3.3 TFLOP and 4 GiB a
  micro-batch). The logits' cotangent p − onehot(t) is weighted by w and rounded to the compute
  dtype before the two products; g, known only in the backward, scales their float32 results, so
  d_h is rounded to the compute dtype once, after it."""
  n, v = h_NxD.shape[0], head_DxV.shape[1]
  w_c = head_DxV.astype(h_NxD.dtype)

  def body(carry, c):
    total, d_head = carry
    h, t, w = c
    logits, lse, nll = _chunk_nll(h, head_DxV, t, w)
    p = jnp.exp(logits - lse[:, None])
    d_logits = ((p - jax.nn.one_hot(t, v, dtype=p.dtype)) * w[:, None]).astype(h.dtype)
    d_h = jnp.einsum("cv,dv->cd", d_logits, w_c, preferred_element_type=jnp.float32)
    d_head = d_head + jnp.einsum("cd,cv->dv", h, d_logits, preferred_element_type=jnp.float32)
    return (total + nll, d_head), d_h

  (total, d_head), d_h = jax.lax.scan(
      body, (jnp.zeros((), jnp.float32), jnp.zeros(head_DxV.shape, jnp.float32)),
      (_chunks(h_NxD, chunk), _chunks(targets_N, chunk), _chunks(weight_N, chunk)))
  d_h = d_h.reshape(-1, h_NxD.shape[1])[:n]
  likes = tuple(jnp.zeros((0,), a.dtype) for a in (h_NxD, head_DxV, weight_N))
  return total, (d_h, d_head, likes)


def _head_nll_bwd(chunk, res, g):
  d_h, d_head, (h_like, head_like, weight_like) = res
  return ((g * d_h).astype(h_like.dtype), (g * d_head).astype(head_like.dtype), None,
          jnp.zeros(d_h.shape[:1], weight_like.dtype))


_head_nll_sum.defvjp(_head_nll_fwd, _head_nll_bwd)


def head_cross_entropy(h_BxTxD: jax.Array, head_DxV: jax.Array, targets_BxT: jax.Array,
                       mask_BxT: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
  """`cross_entropy` of logits h·W (h in the compute dtype, W cast to it, float32 products),
  `chunk` tokens at a time (module docstring). Gradients reach h and W; `targets` and `mask`
  get none."""
  d = h_BxTxD.shape[-1]
  mask = jax.lax.stop_gradient(mask_BxT.astype(jnp.float32)).reshape(-1)
  n = mask.sum()
  total = _head_nll_sum(h_BxTxD.reshape(-1, d), head_DxV,
                        targets_BxT.reshape(-1).astype(jnp.int32), mask, int(chunk))
  return total / jnp.maximum(n, 1.0), n


def objective(cfg: ModelConfig, logits_BxTxV: jax.Array, aux: dict[str, jax.Array],
              batch: dict[str, jax.Array], share: dict[str, jax.Array] | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The training loss and its parts from the model's logits (or, for a model called with
  `return_hidden=True`, from `(hidden_BxTxD, head_DxV)`: `head_cross_entropy` in chunks of
  `cfg.lm_loss_chunk` tokens). With `share` (this micro-batch's fraction of the whole batch's
  loss tokens, documents and per-layer indexer tokens: `batch_counts` ratios, module docstring)
  every part is this micro-batch's contribution to the whole batch's mean."""
  if isinstance(logits_BxTxV, tuple):
    h, head = logits_BxTxV
    lm, n_tokens = head_cross_entropy(h, head, batch["targets"], batch["loss_mask"],
                                      cfg.lm_loss_chunk)
  else:
    lm, n_tokens = cross_entropy(logits_BxTxV, batch["targets"], batch["loss_mask"])
  balance_L, indexer_L = aux["balance_loss"], aux["indexer_loss"]
  if share is not None:
    lm = lm * share["lm"]
    balance_L = balance_L * share["balance"]
    indexer_L = indexer_L * share["indexer"]
  balance = balance_L.sum()                                # one α-weighted term per MoE layer
  indexer = indexer_L.sum()
  total = lm + cfg.balance_loss_weight * balance + cfg.indexer_loss_weight * indexer
  return total, {"lm_loss": lm, "balance_loss": balance, "indexer_loss": indexer,
                 "loss_tokens": n_tokens}


def batch_counts(cfg: ModelConfig, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The units each mean of the objective and of the model's aux runs over, counted in `batch`
  (float32; no parameters needed):

    lm           loss tokens (`loss_mask`)
    balance      documents: runs of one non-zero segment id in a row (§8.4, as
                 `layers.moe.document_starts` finds them)
    indexer [L]  real tokens with at least one visible compressed entry at the layer's ratio, for
                 layers that own an indexer (its top-k then selects one, §5.5); 0 elsewhere
    moe          non-padding tokens (dispatched pairs / K: `dropped_fraction`)
    engram       real text tokens (the Engram gate mean)
    engram_rows  packed rows holding a real text token (the mean of `engram_rows_touched`)
  """
  seg = batch["segment_ids"].astype(jnp.int32)
  real = seg > 0
  text = real & ~batch.get("image_mask", jnp.zeros(seg.shape, bool)).astype(bool)
  f32 = lambda x: jnp.sum(x).astype(jnp.float32)
  by_ratio: dict[int, jax.Array] = {}
  indexer = []
  for spec in build_layer_plan(cfg):
    if not (spec.reads_global_kv and spec.owns_indexer):
      indexer.append(jnp.zeros((), jnp.float32))
      continue
    m = spec.compress_ratio
    if m not in by_ratio:
      entry_seg, entry_last, _ = entry_metadata(batch["positions"], seg, m)
      kv = CompressedKV(None, None, entry_seg, entry_last, None)
      by_ratio[m] = f32(jnp.any(entry_visible(kv, seg), axis=-1) & real)
    indexer.append(by_ratio[m])
  return {"lm": f32(batch["loss_mask"]), "balance": f32(document_starts(seg) & real),
          "indexer": jnp.stack(indexer), "moe": f32(real), "engram": f32(text),
          "engram_rows": f32(jnp.any(text, axis=-1))}
