"""The released `config.json` of DeepSeek-V4.1 and this project's `ModelConfig`, both ways
(docs/checkpoints.md §config.json).

The release nests the language model's fields under `text_config` (a flat file is read too).
Most fields carry `ModelConfig`'s own names; the others:

  rope_scaling {rope_type: yarn, factor, beta_fast, beta_slow, original_max_position_embeddings}
      ↔ yarn_enabled, yarn_factor, yarn_beta_fast, yarn_beta_slow, yarn_original_max_position
      (null ↔ yarn_enabled False)
  candidate_source_layer_id < 0 ↔ use_candidate_pool False
  engram_num_embeddings  the table rows per Engram layer: checked against the hash primes
  fixed values           num_key_value_heads 1, hidden_act silu, attention_bias false,
                         scoring_func sqrtsoftplus, topk_method noaux_tc, norm_topk_prob true
  ignored                num_nextn_predict_layers and dspark_* (the DSpark/MTP heads are not
                         imported), model_type

A field that is neither is refused by name, as is a fixed field with another value: the import
cannot honour what it does not know. Implementation choices (dtype, kernels, dispatch, seq_len, the
quantization-aware switches) are not in the release; they come from the project config.
"""

from __future__ import annotations

from typing import Any

from dsv41_jax.config import ModelConfig
from launch import released_layout

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}

SAME_NAME = (
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank",
    "o_groups", "swiglu_limit", "rms_norm_eps", "max_position_embeddings", "rope_theta",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor",
    "gate_temp", "sliding_window", "compress_ratios", "compress_rope_theta", "kv_source_layer_ids",
    "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "engram_layer_ids", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads",
    "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size",
)
FIXED = {"num_key_value_heads": 1, "hidden_act": "silu", "attention_bias": False,
         "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True}
IGNORED = ("model_type", "num_nextn_predict_layers")
YARN = {"factor": "yarn_factor", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow",
        "original_max_position_embeddings": "yarn_original_max_position"}
# Fields `model_fields` derives; a project config must agree with the checkpoint on all of them.
DERIVED = SAME_NAME + tuple(YARN.values()) + ("yarn_enabled", "use_candidate_pool",
                                              "candidate_source_layer_id")


class ConfigMismatch(ValueError):
  """The released config.json cannot be honoured; the message names the fields."""


def _plain(v: Any) -> Any:
  return list(v) if isinstance(v, (list, tuple)) else v


def text_config(cfg: ModelConfig) -> dict[str, Any]:
  """The `text_config` of a release of `cfg`."""
  out: dict[str, Any] = {"model_type": f"{MODEL_TYPE}_text"}
  out.update({k: _plain(getattr(cfg, k)) for k in SAME_NAME})
  out.update(FIXED)
  out["rope_scaling"] = ({"rope_type": "yarn", **{k: getattr(cfg, v) for k, v in YARN.items()}}
                         if cfg.yarn_enabled else None)
  out["candidate_source_layer_id"] = cfg.candidate_source_layer_id if cfg.use_candidate_pool else -1
  rows = released_layout.engram_rows(cfg)
  out["engram_num_embeddings"] = [rows[l] for l in cfg.engram_layer_ids]
  out["num_nextn_predict_layers"] = 0
  return out


def config_json(cfg: ModelConfig) -> dict[str, Any]:
  """The whole `config.json` of a text-only release of `cfg` (no vision_config: the ViT is not
  exported)."""
  return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": "bfloat16",
          "pad_token_id": cfg.engram_pad_token_id, "quantization_config": dict(QUANTIZATION),
          "text_config": text_config(cfg)}


def unexportable(cfg: ModelConfig) -> list[str]:
  """Settings the released layout cannot express (each a sentence naming the field)."""
  out = []
  if cfg.residual != "mhc":
    out.append(f"model.residual = {cfg.residual!r}: the release has mHC streams")
  if cfg.q_head_norm:
    out.append("model.q_head_norm = True: the V4.1 ports have no per-head q norm")
  if cfg.kv_source_input != "own":
    out.append(f"model.kv_source_input = {cfg.kv_source_input!r}: the ports project the KV of "
               "every Full layer from its own input")
  if cfg.engram_fp8_table:
    out.append("model.engram_fp8_table = True: export and import use the float table (FP8 "
               "tables are frozen storage made from it)")
  return out


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
  """ModelConfig fields from a released config.json; ConfigMismatch naming what cannot be read."""
  top_type = config.get("model_type")
  text = config.get("text_config", config)
  kind = text.get("model_type", top_type)
  if top_type not in (MODEL_TYPE, None) or kind not in (MODEL_TYPE, f"{MODEL_TYPE}_text", None):
    raise ConfigMismatch(f"config.json has model_type {top_type or kind!r}, not {MODEL_TYPE!r} "
                         "(only the V4.1 layout is read; V4 and V3 differ in attention and mHC)")
  problems, fields = [], {}
  for k, v in text.items():
    if k in SAME_NAME:
      fields[k] = tuple(v) if isinstance(v, list) else v
    elif k in FIXED:
      if v != FIXED[k]:
        problems.append(f"{k} = {v!r} (this model has {FIXED[k]!r})")
    elif k == "rope_scaling":
      if v is None:
        fields["yarn_enabled"] = False
      elif v.get("rope_type", v.get("type")) in ("yarn", "deepseek_yarn"):
        fields["yarn_enabled"] = True
        fields.update({YARN[a]: b for a, b in v.items() if a in YARN})
        unknown = sorted(set(v) - set(YARN) - {"rope_type", "type"})
        if unknown:
          problems.append(f"rope_scaling.{unknown[0]} (unknown YaRN field)")
      else:
        problems.append(f"rope_scaling.rope_type = {v.get('rope_type')!r} (only YaRN is "
                        "implemented)")
    elif k == "candidate_source_layer_id":
      fields["use_candidate_pool"] = v >= 0
      if v >= 0:
        fields["candidate_source_layer_id"] = v
    elif k == "engram_num_embeddings" or k in IGNORED or k.startswith("dspark_"):
      continue
    else:
      problems.append(f"{k} (unknown field)")
  if problems:
    raise ConfigMismatch("config.json has fields this model cannot honour: "
                         + "; ".join(problems))
  return fields


def check_rows(config: dict[str, Any], cfg: ModelConfig) -> None:
  """The release's Engram table rows equal this model's hash layout (the same primes)."""
  given = config.get("text_config", config).get("engram_num_embeddings")
  if given is None:
    return
  rows = released_layout.engram_rows(cfg)
  want = [rows[l] for l in cfg.engram_layer_ids]
  if list(given) != want:
    raise ConfigMismatch(f"config.json engram_num_embeddings {list(given)} differ from the rows "
                         f"of this model's Engram hash layout {want} (engram_vocab_size, "
                         "engram_max_ngram_size, engram_n_heads and engram_layer_ids decide them)")


def disagreements(released: dict[str, Any], model: dict[str, Any]) -> list[str]:
  """Fields where the checkpoint's values and a project config's model section differ."""
  out = []
  for k, v in released.items():
    mine = model.get(k)
    if _plain(mine) != _plain(v):   # 10000 == 10000.0: JSON integers match float fields
      out.append(f"config.model.{k} is {mine!r} in the config, {_plain(v)!r} in the checkpoint")
  return out
