"""DeepSeekMoE: sqrt-softplus routing with selection bias, clamped SwiGLU experts (docs/design.md §8).

Shapes through `MoE.__call__`:
  x_BxTxD --router (fp32)--> logits_BxTxE --route--> weights_BxTxK, experts_BxTxK, scores_BxTxE
  routed:  moe_dispatch.routed_experts(x, weights, experts) -> BxTxD (only the routed pairs)
  shared:  clamped SwiGLU of x (n_shared_experts = 1) -> BxTxD, added
  aux:     balance_loss (§8.4, per document), load_2xE (text / image token counts for the
           auxiliary-loss-free bias update of §8.3), dropped_fraction (capacity mode)

The selection bias is state of the train loop, not a parameter: it comes in as `bias_2xE`
(row 0 text, row 1 image) and only changes which experts are selected (§8.1, §8.3).
Padding tokens (segment_id 0, docs/design.md §14) are not dispatched, add no load and no balance loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dsv41_jax import sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import moe_dispatch


def route(logits_BxTxE, bias, k: int, route_scale: float, gate_temp: float = 1.0):
  """Top-k routing of docs/design.md §8.1.

  s = sqrt(softplus(ℓ / gate_temp)); the selection is top-k of s + b (b broadcastable to the
  logits: [E] or per token [B, T, E]); the weights are the UNBIASED s of the selected experts,
  normalised over them (+1e-20) and times `route_scale`. The bias carries no gradient.

  Returns (weights_BxTxK float32, experts_BxTxK int32, scores_BxTxE float32).
  """
  logits = logits_BxTxE.astype(jnp.float32) / gate_temp
  scores = jnp.sqrt(jax.nn.softplus(logits))
  biased = scores + jax.lax.stop_gradient(jnp.asarray(bias, jnp.float32))
  _, experts = jax.lax.top_k(biased, k)
  chosen = jnp.take_along_axis(scores, experts, axis=-1)
  weights = chosen / (chosen.sum(-1, keepdims=True) + 1e-20) * route_scale
  return weights, experts.astype(jnp.int32), scores


def document_starts(segment_ids_BxT):
  """[B, T] bool: True where a run of equal segment ids begins in its row (a document, or a run
  of padding where the id is 0)."""
  change = segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]
  return jnp.concatenate([jnp.ones_like(change[:, :1]), change], axis=1)


def expert_onehot(experts_BxTxK, n_experts: int):
  """[B, T, E] float32: 1 where expert i was selected for the token."""
  return jax.nn.one_hot(experts_BxTxK, n_experts, dtype=jnp.float32).sum(axis=-2)


def document_totals(v_BxTxC, segment_ids_BxT):
  """Each token's sum of v over its document (a run of equal segment ids in a row), [B, T, C].

  Inclusive prefix sums read at the run's last token less the exclusive prefix sum at its first:
  gathers along T, no scatter (a `segment_sum` over B·T segments was one on the GPU). Exact for
  counts (integer-valued float32 below 2^24); meant for values that carry no gradient."""
  t = segment_ids_BxT.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)[None, :]
  first = document_starts(segment_ids_BxT)
  last = jnp.concatenate([first[:, 1:], jnp.ones_like(first[:, :1])], axis=1)
  start = jax.lax.cummax(jnp.where(first, pos, 0), axis=1)[..., None]
  end = jax.lax.cummin(jnp.where(last, pos, t - 1), axis=1, reverse=True)[..., None]
  inclusive = jnp.cumsum(v_BxTxC, axis=1)
  exclusive = inclusive - v_BxTxC
  return (jnp.take_along_axis(inclusive, end, axis=1)
          - jnp.take_along_axis(exclusive, start, axis=1))


def sequence_balance_loss(scores_BxTxE, experts_BxTxK, segment_ids_BxT):
  """Sequence-wise balance loss of docs/design.md §8.4, unweighted (α applied by the caller).

  Per DOCUMENT (a packed row holds several; a document is a run of equal non-zero segment ids):
    f_i = E / (K·T_doc) · Σ_t 1[i ∈ sel_t],  P_i = (1/T_doc) Σ_t s_{t,i} / Σ_j s_{t,j},
    L_doc = Σ_i f_i P_i,   loss = mean of L_doc over the documents in the batch.
  s are the unbiased sqrt-softplus scores; f carries no gradient. Padding is no document.

  As f has no gradient, L_doc is linear in the normalised scores: Σ_{t ∈ doc} Σ_i ŝ_{t,i} · w_{t,i}
  with w = E/K · count_i / T_doc² of the token's document, so the per-document sums are needed
  only for the counts (`document_totals`, no gradient) and the scores' gradient is elementwise.
  """
  e = scores_BxTxE.shape[-1]
  k = experts_BxTxK.shape[-1]
  valid = (segment_ids_BxT != 0)
  validf = valid.astype(jnp.float32)[..., None]                        # [B, T, 1]
  sel = expert_onehot(experts_BxTxK, e) * validf                       # [B, T, E]
  s = scores_BxTxE.astype(jnp.float32)
  s_norm = s / s.sum(-1, keepdims=True) * validf
  totals = jax.lax.stop_gradient(
      document_totals(jnp.concatenate([validf, sel], axis=-1), segment_ids_BxT))
  n_doc, count = totals[..., :1], totals[..., 1:]
  w = (e / k) * count / jnp.square(jnp.maximum(n_doc, 1.0))
  n_docs = (document_starts(segment_ids_BxT) & valid).sum()
  return (s_norm * w).sum() / jnp.maximum(n_docs, 1).astype(jnp.float32)


def expert_load(experts_BxTxK, segment_ids_BxT, image_mask_BxT, n_experts: int):
  """[2, E] float32 token counts per expert: row 0 text tokens, row 1 image tokens; no padding."""
  sel = expert_onehot(experts_BxTxK, n_experts)
  valid = segment_ids_BxT != 0
  text = (valid & ~image_mask_BxT).astype(jnp.float32)
  image = (valid & image_mask_BxT).astype(jnp.float32)
  return jnp.stack([jnp.einsum("bte,bt->e", sel, text), jnp.einsum("bte,bt->e", sel, image)])


# `ModelConfig.router_precision` -> the router product's `precision` (its transposes inherit it).
ROUTER_PRECISION = {"highest": jax.lax.Precision.HIGHEST,
                    "bf16_6x": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6}


class Experts(nnx.Module):
  """Routed expert weights: w1, w3 [expert, embed, mlp], w2 [expert, mlp, embed]."""

  def __init__(self, n_experts: int, d: int, f: int, rngs: nnx.Rngs, dtype):
    self.w1 = sharding.param(rngs, (n_experts, d, f), ("expert", "embed", "mlp"),
                             sharding.fan_in_normal((1,)), dtype)
    self.w3 = sharding.param(rngs, (n_experts, d, f), ("expert", "embed", "mlp"),
                             sharding.fan_in_normal((1,)), dtype)
    self.w2 = sharding.param(rngs, (n_experts, f, d), ("expert", "mlp", "embed"),
                             sharding.fan_in_normal((1,)), dtype)


class SharedExpert(nnx.Module):
  """The always-on expert (docs/design.md §8.2): same width and clamp as a routed one."""

  def __init__(self, d: int, f: int, limit: float, rngs: nnx.Rngs, dtype):
    self.limit = limit
    self.w1 = sharding.param(rngs, (d, f), ("embed", "mlp"), sharding.fan_in_normal((0,)), dtype)
    self.w3 = sharding.param(rngs, (d, f), ("embed", "mlp"), sharding.fan_in_normal((0,)), dtype)
    self.w2 = sharding.param(rngs, (f, d), ("mlp", "embed"), sharding.fan_in_normal((0,)), dtype)

  def __call__(self, x_BxTxD):
    dt = x_BxTxD.dtype
    mm = lambda x, w, eq: moe_dispatch.expert_einsum(eq, x, w[...].astype(dt))
    a = mm(x_BxTxD, self.w1, "btd,df->btf")
    u = mm(x_BxTxD, self.w3, "btd,df->btf")
    h = moe_dispatch.clamped_swiglu(a, u, self.limit).astype(dt)
    return mm(h, self.w2, "btf,fd->btd")


class MoE(nnx.Module):
  """DeepSeekMoE layer (docs/design.md §8): router, routed experts, optional shared expert."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    pdt = jnp.dtype(cfg.param_dtype)
    self.n_experts = e
    self.k = cfg.num_experts_per_tok
    self.route_scale = cfg.routed_scaling_factor
    self.gate_temp = cfg.gate_temp
    self.limit = cfg.swiglu_limit
    self.mode = cfg.moe_dispatch
    self.capacity_factor = cfg.moe_capacity_factor
    self.grouped_matmul_policy = cfg.ops.grouped_matmul
    self.product_dtype = cfg.moe_product_dtype
    self.router_precision = ROUTER_PRECISION[cfg.router_precision]
    self.dtype = jnp.dtype(cfg.dtype)
    self.router = sharding.param(rngs, (d, e), ("embed", "expert_router"),
                                 sharding.fan_in_normal((0,)), pdt)
    self.experts = Experts(e, d, f, rngs, pdt)
    self.shared = (SharedExpert(d, f, cfg.swiglu_limit, rngs, pdt)
                   if cfg.n_shared_experts == 1 else None)

  def __call__(self, x_BxTxD, *, segment_ids_BxT, image_mask_BxT, bias_2xE):
    """Returns (y_BxTxD in x's dtype, aux dict: balance_loss, load_2xE, dropped_fraction)."""
    # Kept under layer remat (`moe_dispatch.KEPT`): the logits (B·T·E float32), whose HIGHEST
    # float32 product the backward would run again, and the output (B·T·D in x's dtype), which the
    # mHC site's backward reads: recomputing it re-ran both down-projections and the combine,
    # whose own gradients need only their inputs.
    logits = checkpoint_name(jnp.einsum("btd,de->bte", x_BxTxD.astype(jnp.float32),
                                        self.router[...].astype(jnp.float32),
                                        precision=self.router_precision), moe_dispatch.KEPT)
    bias_BxTxE = jnp.where(image_mask_BxT[..., None], bias_2xE[1], bias_2xE[0])
    weights, experts, scores = route(logits, bias_BxTxE, self.k, self.route_scale, self.gate_temp)
    valid = segment_ids_BxT != 0
    x = x_BxTxD.astype(self.dtype)
    y, dropped = moe_dispatch.routed_experts(
        x, weights, experts, valid, self.experts.w1[...], self.experts.w3[...],
        self.experts.w2[...], mode=self.mode, capacity_factor=self.capacity_factor,
        swiglu_limit=self.limit, policy=self.grouped_matmul_policy,
        product_dtype=self.product_dtype)
    if self.shared is not None:
      y = y + self.shared(x)
    n_pairs = valid.sum() * self.k
    aux = dict(
        balance_loss=sequence_balance_loss(scores, experts, segment_ids_BxT),
        load_2xE=expert_load(experts, segment_ids_BxT, image_mask_BxT, self.n_experts),
        dropped_fraction=dropped.sum() / jnp.maximum(n_pairs, 1).astype(jnp.float32),
    )
    return checkpoint_name(y.astype(x_BxTxD.dtype), moe_dispatch.KEPT), aux
