"""Model configuration: every field of docs/design.md §1, defaulting to the full V4.1-Flash size.

`ModelConfig` is frozen and validated when built: an inconsistent combination of fields raises
`ConfigError` (`dsv41_jax.errors`) naming the fields involved. The layer plan (docs/design.md §2)
is derived from it once, in `dsv41_jax.layer_plan`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Mapping

from dsv41_jax.errors import ConfigError
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.vision.config import VisionConfig
from pallas_kernels import dispatch

Policy = Literal["auto", "reference", "kernel"]


@dataclasses.dataclass(frozen=True)
class OpPolicies:
  """How each hot-path op of the model runs (docs/design.md §T5; `pallas_kernels.dispatch`).

  "auto": the op's kernel where it is measured faster on this backend and shape (the rules cite
  benchmarks/RESULTS.md), else its reference, with one log line naming the op and the reason;
  "reference": the pure-jnp op; "kernel": the kernel, an error where it cannot run. One field per
  registered model op; a config sets them as `model.ops.<op>`.
  """

  fake_quant_fp4_main_kv: Policy = dispatch.default_policy("fake_quant_fp4_main_kv")
  fake_quant_mxfp4: Policy = dispatch.default_policy("fake_quant_mxfp4")
  fake_quant_fp8_swa: Policy = dispatch.default_policy("fake_quant_fp8_swa")
  hc_coefficients: Policy = dispatch.default_policy("hc_coefficients")
  hc_site: Policy = dispatch.default_policy("hc_site")
  sparse_attention: Policy = dispatch.default_policy("sparse_attention")
  indexer_topk: Policy = dispatch.default_policy("indexer_topk")
  grouped_matmul: Policy = dispatch.default_policy("grouped_matmul")

  def __post_init__(self):
    errors = []
    for f in dataclasses.fields(self):
      try:
        dispatch.check_policy(f.name, getattr(self, f.name))
      except dispatch.PolicyError as e:
        errors.append(f"ops.{e}".replace("ops.op ", "ops.", 1))
    if errors:
      raise ConfigError("; ".join(errors))

  @classmethod
  def of(cls, values: "OpPolicies | Mapping[str, str]") -> "OpPolicies":
    """OpPolicies from itself or a mapping of op -> policy (unknown ops are a ConfigError)."""
    if isinstance(values, cls):
      return values
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"ops has unknown ops {unknown}; the model's ops are {sorted(known)}")
    return cls(**dict(values))


def _flash_compress_ratios() -> tuple[int, ...]:
  # Released V4.1-Flash: two pure-SWA layers, an encoder at m = 2, a decoder at m = 1.
  return (0, 0) + (2,) * 18 + (1,) * 20


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """DeepSeek-V4.1-Flash hyper-parameters (docs/design.md §1) plus implementation choices."""

  # --- sizes (docs/design.md §1) ---
  vocab_size: int = 129280
  hidden_size: int = 5120
  num_hidden_layers: int = 40
  num_attention_heads: int = 64
  head_dim: int = 512
  qk_rope_head_dim: int = 64
  q_lora_rank: int = 1280
  o_groups: int = 8
  o_lora_rank: int = 1024
  sliding_window: int = 128
  compress_ratios: tuple[int, ...] = dataclasses.field(default_factory=_flash_compress_ratios)
  kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
  index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
  index_n_heads: int = 32
  index_head_dim: int = 128
  index_topk: int = 512
  candidate_source_layer_id: int = 20
  candidate_topk_blocks: int = 2048
  candidate_block_size: int = 8
  # The hierarchical candidate pool arrives in post-training (docs/design.md §5.6): off by default.
  use_candidate_pool: bool = False
  rope_theta: float = 10000.0
  compress_rope_theta: float = 160000.0
  # YaRN belongs to the long-context phase (docs/design.md §4.5); the released config has it on.
  yarn_enabled: bool = True
  yarn_factor: float = 16.0
  yarn_original_max_position: int = 65536
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  max_position_embeddings: int = 1_048_576
  rms_norm_eps: float = 1e-20
  n_routed_experts: int = 384
  num_experts_per_tok: int = 6
  n_shared_experts: int = 1
  moe_intermediate_size: int = 2304
  routed_scaling_factor: float = 1.5
  swiglu_limit: float = 10.0
  gate_temp: float = 1.0
  hc_mult: int = 4
  hc_sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  # The residual: "mhc" (hc_mult streams mixed by mHC sites, docs/design.md §3) or "plain" (the
  # ablation baseline: one stream, X ← X + F(norm(X)), no mHC parameters; needs hc_mult = 1).
  residual: str = "mhc"
  # Storage dtype of the residual streams X [B, T, n, d] between sublayers ("float32" or
  # "bfloat16"; docs/design.md §3.5). The site math (expand, collapse, the mix, Engram's add) runs
  # in float32 either way and rounds once when it writes X; bfloat16 halves the streams' bytes
  # (what DeepSeek's own V4 code stores) and their cotangents travel in bfloat16 too.
  hc_stream_dtype: Literal["float32", "bfloat16"] = "float32"
  # Each layer's MoE output written into the streams by the next layer's attention site, as one
  # single pass (the op `hc_site`: expand, coefficients, collapse and norm), instead of by XLA at
  # the layer's end and read apart at the next layer's start (`block.defer_output`; docs/design.md
  # §3.3). The same values; on the GPU it puts the layer boundary through the rows site kernel.
  # The plain residual has no sites: nothing to defer, the switch changes nothing there.
  single_pass_boundary: bool = False
  engram_layer_ids: tuple[int, ...] = (1, 14)
  engram_max_ngram_size: int = 4
  engram_n_heads: int = 8
  engram_head_dim: int = 256
  engram_vocab_size: int = 16_000_000
  engram_compressed_vocab_size: int = 99_092
  engram_pad_token_id: int = 2
  # Store Engram tables in FP8 (E4M3, one scale per 32 columns; docs/design.md §7.4): frozen storage
  # for evaluation and memory-bound runs; the optimizer never sees it.
  engram_fp8_table: bool = False

  # --- context the model is trained at (validation of top-k and window against it) ---
  seq_len: int = 65536

  # --- implementation choices ---
  # Decoder KV sources project from their own input or from the stored final encoder state (§6).
  kv_source_input: Literal["own", "encoder_final"] = "own"
  # Per-head unweighted q RMS norm (open question Q1): V4 has it, the V4.1 ports do not.
  q_head_norm: bool = False
  # Quantization-aware training switches (docs/design.md §9); pre-training keeps them off.
  fp4_main_kv: bool = False
  fp4_indexer: bool = False
  fp8_swa_kv: bool = False
  # The XLA form of the global-branch attention over the selected entries (the `sparse_attention`
  # op's reference): "masked" scores all entries and masks to the top-k (fast up to ~16K tokens on
  # the H200), "gather" gathers the k entries per query. The kernel is `ops.sparse_attention`.
  global_attn_impl: Literal["masked", "gather"] = "masked"
  # Queries per chunk in attention and in the indexer (0 = the whole row): bounds the [T, N]
  # score intermediates of long rows (the chunks are recomputed in the backward pass).
  attn_query_chunk: int = 0
  index_query_chunk: int = 512
  # Training's LM loss from the final hidden state in chunks of this many tokens (`loss.
  # head_cross_entropy`: no float32 [B, T, V] logits for the whole batch); 0 = plain logits.
  lm_loss_chunk: int = 0
  # MoE dispatch: "dropless" (exact) or "capacity" (static per-expert capacity).
  moe_dispatch: Literal["dropless", "capacity"] = "dropless"
  moe_capacity_factor: float = 1.25
  # The routed experts' product outputs ([a | u] and the down-projection, before the pairs' float32
  # sum): "float32" (the accumulator as it is) or "compute" (rounded once to `dtype`, as the
  # official V4 code's bf16 Linears round them; half their bytes; `moe_dispatch` module docstring).
  moe_product_dtype: Literal["float32", "compute"] = "float32"
  # The router's float32 product (and its two transposes in the backward): "highest" (float32 at
  # HIGHEST: on a GPU float32 arithmetic, off the tensor cores) or "bf16_6x" (the same product as
  # six bfloat16 tensor-core products of the operands' three-part splits, float32 accumulation:
  # exact for bfloat16 activations times float32 weights up to the sum's rounding; XLA's
  # BF16_BF16_F32_X6 algorithm; on the CPU XLA computes it in float32). docs/design.md §8.2.
  router_precision: Literal["highest", "bf16_6x"] = "highest"
  # Loss weights: sequence-wise balance loss (docs/design.md §8.4) and the indexer KL loss (§5.5).
  balance_loss_weight: float = 1e-4
  indexer_loss_weight: float = 1.0
  # mHC initialisation (docs/design.md §3.4): fn std, pre base, diagonal of the residual base.
  hc_init_fn_std: float = 1e-3
  hc_init_pre_base: float = 0.0
  hc_init_res_diag: float = 6.0
  # How each hot-path op runs: its reference or its kernel ("auto" | "reference" | "kernel").
  ops: OpPolicies = dataclasses.field(default_factory=OpPolicies)
  # Compile repeated layer groups once with lax.scan (MODEL issue item 9).
  scan_layers: bool = True
  # Rematerialise each layer in the backward pass.
  remat: bool = True
  # What layer remat keeps beyond its fixed set (`dsv41_jax.model.remat_policy`), from
  # REMAT_SAVES: "projections" (outputs of the dense matmuls: attention, indexer, shared experts,
  # Engram), "experts" (the routed experts' gate|up product). More memory, less recompute.
  remat_saves: tuple[str, ...] = ()
  param_dtype: str = "float32"
  dtype: str = "bfloat16"
  # The train step casts the dense and expert matmul weights that are only ever read in `dtype`
  # to it once per step, before the forward and every micro-batch (`launch.step.CAST_ONCE`), not
  # once per use in each forward and remat pass, the routed experts' w1 and w3 as one pair that the
  # gate/up product reads without a per-layer concatenation. The same step bit for bit on the CPU;
  # on the GPU the second step's loss differs at 4e-4 relative, as two runs of the same program do
  # (benchmarks/RESULTS.md, sessions 46, 51 and 55), and the s1 loss A/B over 3 seeds (with
  # `train.unfilled_buffers`) found no difference (session 56). On in configs/small.py from s3 up.
  cast_weights_once: bool = False
  # The vision pathway (ViT + projector, `dsv41_jax.vision.config.VisionConfig`); None = text only.
  vision: VisionConfig | None = None

  def __post_init__(self):
    object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
      object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
    object.__setattr__(self, "ops", OpPolicies.of(self.ops))
    object.__setattr__(self, "remat_saves", tuple(self.remat_saves))
    _validate(self)

  # --- derived sizes ---
  @property
  def num_encoder_layers(self) -> int:
    return self.num_hidden_layers // 2

  @property
  def heads_per_group(self) -> int:
    return self.num_attention_heads // self.o_groups

  @property
  def engram_orders(self) -> tuple[int, ...]:
    return tuple(range(2, self.engram_max_ngram_size + 1))

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


# What `ModelConfig.remat_saves` may name (`dsv41_jax.model.remat_policy` reads them).
REMAT_SAVES = ("projections", "experts")


def _validate(c: ModelConfig) -> None:
  errors: list[str] = []

  def need(cond: bool, msg: str):
    if not cond:
      errors.append(msg)

  positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
              "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
              "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "seq_len"]
  for name in positive:
    need(getattr(c, name) > 0, f"{name} must be positive (got {getattr(c, name)})")
  unknown = sorted(set(c.remat_saves) - set(REMAT_SAVES))
  need(not unknown, f"remat_saves has unknown entries {unknown}; known: {list(REMAT_SAVES)}")
  if errors:
    raise ConfigError("; ".join(errors))

  need(c.num_attention_heads % c.o_groups == 0,
       f"num_attention_heads ({c.num_attention_heads}) is not divisible into o_groups ({c.o_groups})")
  need(0 < c.qk_rope_head_dim <= c.head_dim and c.qk_rope_head_dim % 2 == 0,
       f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be even and at most head_dim ({c.head_dim})")
  need(0 < c.qk_rope_head_dim <= c.index_head_dim,
       f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be at most index_head_dim ({c.index_head_dim})")
  need(c.num_hidden_layers % 2 == 0,
       f"num_hidden_layers ({c.num_hidden_layers}) must be even: CED splits it into encoder and decoder halves")
  need(len(c.compress_ratios) == c.num_hidden_layers,
       f"compress_ratios has {len(c.compress_ratios)} entries, num_hidden_layers is {c.num_hidden_layers}")
  need(all(r >= 0 for r in c.compress_ratios), "compress_ratios must be >= 0")
  need(c.num_experts_per_tok <= c.n_routed_experts,
       f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds n_routed_experts ({c.n_routed_experts})")
  need(c.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1 (got {c.n_shared_experts})")
  need(c.sliding_window <= c.seq_len,
       f"sliding_window ({c.sliding_window}) is larger than the sequence (seq_len {c.seq_len})")
  need(c.head_dim % 16 == 0 or not c.fp4_main_kv,
       f"head_dim ({c.head_dim}) must be a multiple of 16 for fp4_main_kv")
  need(c.head_dim % 32 == 0 or not c.fp8_swa_kv,
       f"head_dim ({c.head_dim}) must be a multiple of 32 for fp8_swa_kv")
  need(c.index_head_dim % 32 == 0 or not c.fp4_indexer,
       f"index_head_dim ({c.index_head_dim}) must be a multiple of 32 for fp4_indexer")
  need(c.kv_source_input in ("own", "encoder_final"),
       f"kv_source_input must be 'own' or 'encoder_final' (got {c.kv_source_input!r})")
  need(c.global_attn_impl != "pallas",
       "global_attn_impl='pallas' is gone: the kernel is the policy ops.sparse_attention='kernel' "
       "(global_attn_impl picks the XLA form, 'masked' or 'gather')")
  need(c.global_attn_impl in ("masked", "gather", "pallas"),
       f"global_attn_impl must be 'masked' or 'gather' (got {c.global_attn_impl!r})")
  need(c.moe_dispatch in ("dropless", "capacity"),
       f"moe_dispatch must be 'dropless' or 'capacity' (got {c.moe_dispatch!r})")
  need(c.attn_query_chunk >= 0 and c.index_query_chunk >= 0,
       "attn_query_chunk and index_query_chunk must be >= 0 (0 = the whole row)")
  need(c.lm_loss_chunk >= 0, f"lm_loss_chunk must be >= 0 (got {c.lm_loss_chunk}; 0 = plain "
       "logits)")
  need(c.moe_product_dtype in ("float32", "compute"),
       f"moe_product_dtype must be 'float32' or 'compute' (got {c.moe_product_dtype!r})")
  need(c.router_precision in ("highest", "bf16_6x"),
       f"router_precision must be 'highest' or 'bf16_6x' (got {c.router_precision!r})")
  need(c.moe_capacity_factor > 0, f"moe_capacity_factor must be positive (got {c.moe_capacity_factor})")
  need(c.residual in ("mhc", "plain"), f"residual must be 'mhc' or 'plain' (got {c.residual!r})")
  need(c.hc_stream_dtype in ("float32", "bfloat16"),
       f"hc_stream_dtype must be 'float32' or 'bfloat16' (got {c.hc_stream_dtype!r})")
  need(c.residual == "mhc" or c.hc_mult == 1,
       f"residual='plain' is one stream: hc_mult must be 1 (got {c.hc_mult})")
  n = c.num_hidden_layers
  for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
    ids = getattr(c, name)
    need(all(0 <= i < n for i in ids),
         f"{name} {list(ids)} names a layer that does not exist (num_hidden_layers {n})")
    need(list(ids) == sorted(set(ids)), f"{name} {list(ids)} must be strictly increasing")
  if errors:
    raise ConfigError("; ".join(errors))

  for i in c.kv_source_layer_ids:
    need(c.compress_ratios[i] != 0,
         f"kv_source_layer_ids contains layer {i}, whose compress_ratios entry is 0 (a pure-SWA layer "
         "cannot be a CSA2 Full layer)")
    need(i in c.index_source_layer_ids,
         f"kv_source_layer_ids contains layer {i}, which is missing from index_source_layer_ids "
         "(a Full layer owns an indexer)")
  for i in c.index_source_layer_ids:
    need(c.compress_ratios[i] != 0,
         f"index_source_layer_ids contains layer {i}, whose compress_ratios entry is 0")
  for m in sorted({r for r in c.compress_ratios if r}):
    visible = c.seq_len // m
    need(c.index_topk <= visible,
         f"index_topk ({c.index_topk}) is larger than the {visible} compressed entries visible at "
         f"seq_len {c.seq_len} with compress ratio {m}")
  if c.use_candidate_pool:
    src = c.candidate_source_layer_id
    need(0 <= src < n and src in c.index_source_layer_ids,
         f"candidate_source_layer_id ({src}) must be one of index_source_layer_ids")
    need(c.candidate_block_size > 0 and c.candidate_topk_blocks > 0,
         "candidate_block_size and candidate_topk_blocks must be positive")
  need(c.engram_vocab_size > 0, f"engram_vocab_size (the table-size search start) must be positive "
       f"(got {c.engram_vocab_size})")
  need(c.engram_max_ngram_size >= 2,
       f"engram_max_ngram_size must be at least 2 (got {c.engram_max_ngram_size})")
  need(c.engram_n_heads > 0 and c.engram_head_dim > 0,
       "engram_n_heads and engram_head_dim must be positive")
  if c.vision is not None:
    need(isinstance(c.vision, VisionConfig),
         f"vision must be a VisionConfig or None (got {type(c.vision).__name__})")
  if errors:
    raise ConfigError("; ".join(errors))
  # The plan's own checks (every Reuse layer has a source, ratios agree) live beside the plan.
  build_layer_plan(c)
