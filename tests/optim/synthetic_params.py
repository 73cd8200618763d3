"""An abstract parameter tree built from the model's naming note, for testing the optimizer table
before (and beside) `dsv41_jax.model.abstract_params`.

Layers sit under `runs/<r>/core/...` (one leading stacked axis: the run's layers),
`runs/<r>/<kind>/{compressor,indexer}/...` (stacked over the run's layers of that kind) and
`runs/<r>/engram/...` (the run's first layer), as the scanned model stores them. Shapes follow the
naming note; only paths and ranks matter here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan


def _sds(*shape):
  return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), jnp.float32)


def _core(cfg: ModelConfig) -> dict:
  d, n, h, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
  mix = (2 + n) * n
  hc = lambda: {"fn": _sds(mix, n * d), "base": _sds(mix), "scale": _sds(3)}
  layer = {
      "attn_hc": hc(), "ffn_hc": hc(),
      "attn_norm": {"scale": _sds(d)}, "ffn_norm": {"scale": _sds(d)},
      "attn": {
          "wq_a": _sds(d, cfg.q_lora_rank), "q_norm": {"scale": _sds(cfg.q_lora_rank)},
          "wq_b": _sds(cfg.q_lora_rank, h, hd), "wkv": _sds(d, hd), "kv_norm": {"scale": _sds(hd)},
          "attn_sink": _sds(h), "wo_a": _sds(cfg.o_groups, cfg.heads_per_group * hd, cfg.o_lora_rank),
          "wo_b": _sds(cfg.o_groups * cfg.o_lora_rank, d),
      },
      "moe": {
          "router": _sds(d, cfg.n_routed_experts),
          "experts": {"w1": _sds(cfg.n_routed_experts, d, cfg.moe_intermediate_size),
                      "w3": _sds(cfg.n_routed_experts, d, cfg.moe_intermediate_size),
                      "w2": _sds(cfg.n_routed_experts, cfg.moe_intermediate_size, d)},
          "shared": {"w1": _sds(d, cfg.moe_intermediate_size), "w3": _sds(d, cfg.moe_intermediate_size),
                     "w2": _sds(cfg.moe_intermediate_size, d)},
      },
  }
  return layer


def _publisher(cfg: ModelConfig, spec) -> dict:
  d, hd = cfg.hidden_size, cfg.head_dim
  pub = {"indexer": {"wq_b": _sds(cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim),
                     "weights_proj": _sds(d, cfg.index_n_heads)}}
  if spec.mode == "full":
    pub["compressor"] = {"wkv": _sds(d, hd), "norm": {"scale": _sds(hd)}}
    if spec.compress_ratio > 1:
      pub["compressor"]["wgate"] = _sds(d, hd)
    pub["indexer"]["wk"] = _sds(hd, cfg.index_head_dim)
    pub["indexer"]["k_norm"] = {"scale": _sds(cfg.index_head_dim)}
  return pub


def _engram(cfg: ModelConfig) -> dict:
  d, n, e = cfg.hidden_size, cfg.hc_mult, cfg.engram_head_dim
  n_tables = len(cfg.engram_orders) * cfg.engram_n_heads
  return {"table": _sds(n_tables * cfg.engram_vocab_size, e),
          "w_ekv": _sds(n_tables * e, (n + 1) * d), "q_w": _sds(n, d), "k_w": _sds(n, d)}


def _stack(tree, repeats: int):
  return jax.tree.map(lambda s: _sds(repeats, *s.shape), tree)


def synthetic_params(cfg: ModelConfig) -> dict:
  """Nested dict of ShapeDtypeStructs with the model's parameter paths."""
  plan = build_layer_plan(cfg)
  runs = {}
  for r, run in enumerate(plan.runs):
    stack = {"core": _stack(_core(cfg), run.n_layers)}
    for k, spec in enumerate(run.kinds):
      if spec.owns_indexer:
        stack[spec.kind_name] = _stack(_publisher(cfg, spec), run.kind_count(k))
    if run.engram:
      stack["engram"] = _engram(cfg)
    runs[r] = stack
  tree = {
      "embed": _sds(cfg.vocab_size, cfg.hidden_size),
      "head": _sds(cfg.hidden_size, cfg.vocab_size),
      "final_norm": {"scale": _sds(cfg.hidden_size)},
      "runs": runs,
  }
  if cfg.vision is not None:
    tree.update(_vision(cfg))
  return tree


def _vision(cfg: ModelConfig) -> dict:
  """`vision/...` (ViT, layers stacked) and `projector/...` paths of the vision pathway."""
  v = cfg.vision
  L, D, F = v.num_layers, v.hidden_size, v.intermediate_size
  layer = {"attn_norm": {"scale": _sds(D)}, "mlp_norm": {"scale": _sds(D)},
           "attn": {k: _sds(D, D) for k in ("wq", "wk", "wv", "wo")},
           "mlp": {"w1": _sds(D, F), "w3": _sds(D, F), "w2": _sds(F, D)}}
  d_in = v.unshuffle ** 2 * D
  return {"vision": {"patch_embed": _sds(v.patch_dim, D), "layers": _stack(layer, L),
                     "final_norm": {"scale": _sds(D)}},
          "projector": {"norm": {"scale": _sds(d_in)}, "w1": _sds(d_in, v.projector_hidden),
                        "w2": _sds(v.projector_hidden, cfg.hidden_size)}}
