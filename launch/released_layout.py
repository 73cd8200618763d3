"""Names, shapes and formats of the released DeepSeek-V4.1 checkpoint, and where each tensor
lives in this project's parameter tree (docs/checkpoints.md §Tensor map).

Pure functions of a `ModelConfig` and its layer plan (docs/design.md §2): no file is read and no
array is made, so the Flash-size map is checked from the abstract shapes alone (the ledger's
`abstract_params`). A released tensor is a `Tensor`: its name, its shape as released (linear
weights as [out, in], the PyTorch convention), its storage format (`launch.weight_formats`) and
its `Placement`: the leaf path of this project's tree (`dsv41_jax.param_paths`), the leading
indices of the slice it fills (the layer's row of a run's stack, the expert), and the transform
between the two layouts.

Transforms (ours → released; `to_released` and `from_released` are exact inverses):
  same      unchanged
  T         [in, out] → [out, in]
  heads_T   [in, heads, dim] → [heads·dim, in]              (wq_b of attention and indexer)
  groups    [groups, in/group, rank] → [groups·rank, in/group] (wo_a, block-diagonal)
  rows      [padded rows, dim] → [rows, dim]: the Engram table without its padding rows, which
            no hash id addresses (docs/design.md §7.4); importing fills them with zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram import hashing
from dsv41_jax.layer_plan import build_layer_plan

MOE_BIAS = "moe_bias"       # the train state's routing biases [L, 2 (text, image), E]
# Released tensors this project has no counterpart for: import skips them (docs/checkpoints.md).
DROPPED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")
# Parameters the release has no counterpart for: export leaves them out.
UNRELEASED_PREFIXES = ("vision/", "projector/")


@dataclasses.dataclass(frozen=True)
class Placement:
  path: str                  # leaf path in the parameter tree, or MOE_BIAS
  index: tuple[int, ...]     # leading indices of the slice
  transform: str             # same | T | heads_T | groups | rows


@dataclasses.dataclass(frozen=True)
class Tensor:
  name: str                  # released name of the values ("layers.3.attn.wq_a.weight")
  shape: tuple[int, ...]     # released shape of the decoded values
  storage: str               # bf16 | f32 | fp8 | fp4 | fp8_rows
  placement: Placement

  @property
  def scale_name(self) -> str | None:
    """The companion scale tensor of a quantized weight."""
    if self.storage in ("fp8", "fp4", "fp8_rows"):
      return self.name.removesuffix(".weight") + ".scale"
    return None


def to_released(x: np.ndarray, transform: str, shape: tuple[int, ...]) -> np.ndarray:
  """Our slice → the released tensor of `shape`."""
  if transform == "same":
    return x
  if transform == "T":
    return x.T
  if transform == "heads_T":
    return x.reshape(x.shape[0], -1).T
  if transform == "groups":
    return x.transpose(0, 2, 1).reshape(shape)
  if transform == "rows":
    return x[:shape[0]]
  raise ValueError(f"unknown transform {transform!r}")


def from_released(y: np.ndarray, transform: str, shape: tuple[int, ...]) -> np.ndarray:
  """The released tensor → our slice of `shape` (the inverse of `to_released`)."""
  if transform == "same":
    return y
  if transform == "T":
    return y.T
  if transform == "heads_T":
    return y.T.reshape(shape)
  if transform == "groups":
    g, i, r = shape
    return y.reshape(g, r, i).transpose(0, 2, 1)
  if transform == "rows":
    out = np.zeros(shape, y.dtype)
    out[:y.shape[0]] = y
    return out
  raise ValueError(f"unknown transform {transform!r}")


def released_shape(ours: tuple[int, ...], transform: str, rows: int | None = None
                   ) -> tuple[int, ...]:
  """The released shape that `to_released` makes of a slice of shape `ours`."""
  if transform == "same":
    return tuple(ours)
  if transform == "T":
    return tuple(ours[::-1])
  if transform == "heads_T":
    return (ours[1] * ours[2], ours[0])
  if transform == "groups":
    return (ours[0] * ours[2], ours[1])
  if transform == "rows":
    return (rows, ours[1])
  raise ValueError(f"unknown transform {transform!r}")


def engram_rows(cfg: ModelConfig) -> dict[int, int]:
  """Released rows of each Engram layer's table: the sum of its hash primes (docs/design.md §7.2)."""
  return {l: hashing.engram_hash_params(cfg, l).num_rows for l in cfg.engram_layer_ids}


def released_tensors(cfg: ModelConfig) -> list[Tensor]:
  """Every tensor of the released checkpoint of `cfg`, in the release's order (by layer)."""
  return list(_tensors(cfg))


def _tensors(cfg: ModelConfig) -> Iterator[Tensor]:
  plan = build_layer_plan(cfg)
  d, V, H, D = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
  G, R, Q = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
  E, F, n = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hc_mult
  Hi, Di = cfg.index_n_heads, cfg.index_head_dim
  mix = (2 + n) * n
  rows = engram_rows(cfg)

  def t(name, shape, storage, path, index=(), transform="same"):
    return Tensor(name, tuple(shape), storage, Placement(path, tuple(index), transform))

  yield t("embed.weight", (V, d), "bf16", "embed")
  for spec in plan:
    L = spec.index
    r, i = plan.run_of(L)
    run = plan.runs[r]
    core, p = f"runs/{r}/core", f"layers.{L}"
    c = lambda name, shape, storage, path, transform="same": t(
        f"{p}.{name}", shape, storage, f"{core}/{path}", (i,), transform)
    yield c("attn_norm.weight", (d,), "bf16", "attn_norm/scale")
    yield c("ffn_norm.weight", (d,), "bf16", "ffn_norm/scale")
    for site in ("attn", "ffn"):
      yield c(f"hc_{site}_fn", (mix, n * d), "f32", f"{site}_hc/fn")
      yield c(f"hc_{site}_base", (mix,), "f32", f"{site}_hc/base")
      yield c(f"hc_{site}_scale", (3,), "f32", f"{site}_hc/scale")
    yield c("attn.attn_sink", (H,), "f32", "attn/attn_sink")
    yield c("attn.q_norm.weight", (Q,), "bf16", "attn/q_norm/scale")
    yield c("attn.kv_norm.weight", (D,), "bf16", "attn/kv_norm/scale")
    yield c("attn.wq_a.weight", (Q, d), "fp8", "attn/wq_a", "T")
    yield c("attn.wq_b.weight", (H * D, Q), "fp8", "attn/wq_b", "heads_T")
    yield c("attn.wkv.weight", (D, d), "fp8", "attn/wkv", "T")
    yield c("attn.wo_a.weight", (G * R, H * D // G), "fp8", "attn/wo_a", "groups")
    yield c("attn.wo_b.weight", (d, G * R), "fp8", "attn/wo_b", "T")
    if spec.owns_indexer:
      pub = f"runs/{r}/{spec.kind_name}"
      slot = (run.slot_of[i],)
      u = lambda name, shape, storage, path, transform="same": t(
          f"{p}.attn.{name}", shape, storage, f"{pub}/{path}", slot, transform)
      if spec.owns_compressor:
        yield u("compressor.wkv.weight", (D, d), "bf16", "compressor/wkv", "T")
        if spec.compress_ratio > 1:
          yield u("compressor.wgate.weight", (D, d), "bf16", "compressor/wgate", "T")
        yield u("compressor.norm.weight", (D,), "bf16", "compressor/norm/scale")
        yield u("indexer.wk.weight", (Di, D), "bf16", "indexer/wk", "T")
        yield u("indexer.k_norm.weight", (Di,), "bf16", "indexer/k_norm/scale")
      yield u("indexer.wq_b.weight", (Hi * Di, Q), "fp8", "indexer/wq_b", "heads_T")
      yield u("indexer.weights_proj.weight", (Hi, d), "bf16", "indexer/weights_proj", "T")
    if spec.engram:
      eg, De = f"runs/{r}/engram", cfg.engram_head_dim
      heads = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
      yield t(f"{p}.engram.embed.weight", (rows[L], De), "fp8_rows", f"{eg}/table",
              transform="rows")
      yield t(f"{p}.engram.wkv.weight", ((n + 1) * d, heads * De), "fp8", f"{eg}/w_ekv",
              transform="T")
      yield t(f"{p}.engram.q_weight", (n, d), "bf16", f"{eg}/q_w")
      yield t(f"{p}.engram.k_weight", (n, d), "bf16", f"{eg}/k_w")
    yield c("ffn.gate.weight", (E, d), "bf16", "moe/router", "T")
    yield t(f"{p}.ffn.gate.bias", (E,), "f32", MOE_BIAS, (L, 0))
    yield t(f"{p}.ffn.gate.bias_vl", (E,), "f32", MOE_BIAS, (L, 1))
    if cfg.n_shared_experts:
      for w, shape in (("w1", (F, d)), ("w2", (d, F)), ("w3", (F, d))):
        yield c(f"ffn.shared_experts.{w}.weight", shape, "fp8", f"moe/shared/{w}", "T")
    for e in range(E):
      for w, shape in (("w1", (F, d)), ("w2", (d, F)), ("w3", (F, d))):
        yield t(f"{p}.ffn.experts.{e}.{w}.weight", shape, "fp4", f"{core}/moe/experts/{w}",
                (i, e), "T")
  yield t("norm.weight", (d,), "bf16", "final_norm/scale")
  yield t("head.weight", (V, d), "bf16", "head", transform="T")


def check_coverage(cfg: ModelConfig, leaves: dict[str, tuple[int, ...]],
                   tensors: list[Tensor] | None = None) -> list[str]:
  """Problems of the map against the parameter shapes `leaves` (path → shape, e.g. from
  `param_paths.iter_params` of the abstract state, plus MOE_BIAS): a tensor whose placement is
  not a leaf or whose shape is not the transformed slice, two tensors on one slice, a slice of a
  leaf no tensor fills. Empty when the map is exact. Vision leaves are exempt (not released)."""
  tensors = released_tensors(cfg) if tensors is None else tensors
  problems: list[str] = []
  filled: dict[str, set] = {}
  for tensor in tensors:
    pl = tensor.placement
    if pl.path not in leaves:
      problems.append(f"{tensor.name}: no parameter {pl.path}")
      continue
    shape = leaves[pl.path]
    lead, rest = shape[:len(pl.index)], shape[len(pl.index):]
    if any(not 0 <= k < s for k, s in zip(pl.index, lead)) or len(lead) < len(pl.index):
      problems.append(f"{tensor.name}: index {list(pl.index)} outside {pl.path} {list(shape)}")
      continue
    want = released_shape(rest, pl.transform, tensor.shape[0])
    if want != tensor.shape or (pl.transform == "rows" and tensor.shape[0] > rest[0]):
      problems.append(f"{tensor.name}: released shape {list(tensor.shape)}, but {pl.path}"
                      f"{list(pl.index)} {list(rest)} gives {list(want)}")
    seen = filled.setdefault(pl.path, set())
    if pl.index in seen:
      problems.append(f"{tensor.name}: {pl.path}{list(pl.index)} is filled twice")
    seen.add(pl.index)
  for path, shape in leaves.items():
    if path.startswith(UNRELEASED_PREFIXES):
      continue
    depth = {len(i) for i in filled.get(path, ())}
    if not depth:
      problems.append(f"{path} {list(shape)}: no released tensor")
      continue
    k = depth.pop()
    missing = int(np.prod(shape[:k])) - len(filled[path])
    if missing:
      problems.append(f"{path} {list(shape)}: {missing} of its {int(np.prod(shape[:k]))} slices "
                      "have no released tensor")
  return problems
