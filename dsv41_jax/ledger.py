"""The model's ledger: parameter counts, activated parameters, KV-cache bytes and training FLOPs.

Every figure is computed from the abstract parameter shapes of the real model (`jax.eval_shape`,
no allocation), the layer plan, and the cache layout in `dsv41_jax.cache_layout`: no constant of
the report is typed in here. Conventions (docs/design.md §1 "Sanity checks", §10):

- `engram_params`: the Engram hash tables (rows × dim). The Engram projections (`w_ekv`) and norm
  weights are dense per-token matrices and count with the backbone, like attention.
- `backbone_params`: everything else except the vision pathway.
- Activated parameters per token: every parameter a token's forward pass multiplies by, with routed
  experts counted at k / E and table look-ups (token embedding, Engram table rows) not counted.
  Decode runs all layers and the head; encoder-only prefill (CED, §6) runs the encoder layers plus
  what projects the decoder's KV sources from the final encoder state, and no head.
"""

from __future__ import annotations

from dsv41_jax import cache_layout, flops
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.model import abstract_params
from dsv41_jax.param_paths import per_layer_params


def _is_engram_table(rest: str) -> bool:
  return rest.startswith("engram/table")


def _is_vision(path: str) -> bool:
  return path.startswith(("vision/", "projector/"))


def ledger(cfg: ModelConfig) -> dict[str, float]:
  state = abstract_params(cfg)
  plan = build_layer_plan(cfg)
  k_over_e = cfg.num_experts_per_tok / cfg.n_routed_experts
  n_enc = plan.num_encoder_layers

  total = engram = vision = 0
  active_decode = active_prefill = 0.0
  for layer, rest, size in per_layer_params(cfg, state):
    total += size
    if layer is None:
      if _is_vision(rest):
        vision += size
        continue
      if rest.startswith("head"):
        active_decode += size
      elif not rest.startswith("embed"):
        active_decode += size
        if not rest.startswith("final_norm"):
          active_prefill += size
      continue
    if _is_engram_table(rest):
      engram += size
      continue
    frac = k_over_e if rest.startswith("moe/experts/") else 1.0
    active_decode += size * frac
    spec = plan[layer]
    if layer < n_enc:
      active_prefill += size * frac
    elif spec.prefills_from_encoder:
      # The decoder KV source projects from H_{L/2}: its collapse, attn_norm, compressor, indexer K.
      if rest.startswith(("compressor/", "indexer/wk", "indexer/k_norm", "attn_norm/")):
        active_prefill += size
  layout = cache_layout.global_kv_layout(cfg)
  return {
      "total_params": total,
      "backbone_params": total - engram - vision,
      "engram_params": engram,
      "vision_params": vision,
      "active_params_prefill": int(round(active_prefill)),
      "active_params_decode": int(round(active_decode)),
      "global_kv_bytes_per_token": layout.bytes_per_token,
      "swa_kv_bytes_per_sequence": cache_layout.swa_kv_bytes_per_sequence(cfg),
      "train_flops_per_token": flops.train_flops_per_token(cfg, state=state),
  }
