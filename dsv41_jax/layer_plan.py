"""The static layer plan of MODEL.md §2, computed once from a `ModelConfig`, as data.

Each layer gets a `LayerSpec` (its compression ratio, CSA2 mode, KV and index sources, Engram
flag, candidate role, RoPE base). Layers are then grouped into *units*: a unit starts at a layer
that publishes a top-k (a Full or Reindex layer) and runs through the Reuse layers that consume
it; each pure-SWA layer is a unit of its own. Consecutive units of identical structure form a
*segment*, which the model compiles once and scans over (`Segment.repeats`).

The model, the ledger and the tests all read this table; no model code tests a layer index.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, TYPE_CHECKING

if TYPE_CHECKING:
  from dsv41_jax.config import ModelConfig

Mode = Literal["swa", "full", "reindex", "reuse"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One layer's static role."""

  index: int
  compress_ratio: int           # 0 = pure SWA, no global branch
  mode: Mode
  kv_source: int | None         # the Full layer whose compressed main KV this layer attends to
  index_source: int | None      # the Full/Reindex layer whose top-k this layer uses
  engram: bool                  # Engram injection before this layer's attention
  candidate_role: Literal["source", "consumer"] | None
  is_encoder: bool
  # Full layers: project the compressor from the layer's own input or from the final encoder state.
  kv_input: Literal["own", "encoder_final"] | None
  rope_theta: float
  yarn: bool

  def structure(self) -> tuple:
    """Everything that shapes the layer's computation graph, without its position in the stack."""
    return (self.compress_ratio, self.mode, self.engram, self.candidate_role, self.kv_input,
            self.rope_theta, self.yarn, self.is_encoder)


@dataclasses.dataclass(frozen=True)
class Segment:
  """`repeats` consecutive units, each of the layers `unit` (relative structure identical)."""

  first_layer: int
  unit: tuple[LayerSpec, ...]   # the specs of the first repeat
  repeats: int

  @property
  def unit_len(self) -> int:
    return len(self.unit)

  @property
  def layers(self) -> tuple[int, ...]:
    return tuple(range(self.first_layer, self.first_layer + self.unit_len * self.repeats))


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  layers: tuple[LayerSpec, ...]
  segments: tuple[Segment, ...]
  num_encoder_layers: int

  def __iter__(self):
    return iter(self.layers)

  def __len__(self):
    return len(self.layers)

  def __getitem__(self, i: int) -> LayerSpec:
    return self.layers[i]

  @property
  def kv_sources(self) -> tuple[int, ...]:
    return tuple(l.index for l in self.layers if l.mode == "full")

  def table(self) -> str:
    """A printable table of the plan, one row per layer."""
    rows = ["layer ratio mode     kv_src idx_src engram cand      part"]
    for l in self.layers:
      rows.append(f"{l.index:5d} {l.compress_ratio:5d} {l.mode:8s} {str(l.kv_source):6s} "
                  f"{str(l.index_source):7s} {str(l.engram):6s} {str(l.candidate_role):9s} "
                  f"{'enc' if l.is_encoder else 'dec'}")
    return "\n".join(rows)


def build_layer_plan(cfg: "ModelConfig") -> LayerPlan:
  """Derive the plan from the config; raise `ConfigError` naming the fields on inconsistency."""
  from dsv41_jax.config import ConfigError

  n_enc = cfg.num_hidden_layers // 2
  kv_ids = set(cfg.kv_source_layer_ids)
  idx_ids = set(cfg.index_source_layer_ids)
  specs: list[LayerSpec] = []
  last_kv: int | None = None
  last_idx: int | None = None
  for i, m in enumerate(cfg.compress_ratios):
    if m == 0:
      mode: Mode = "swa"
    elif i in kv_ids:
      mode = "full"
    elif i in idx_ids:
      mode = "reindex"
    else:
      mode = "reuse"
    if mode == "full":
      last_kv = i
    if mode in ("full", "reindex"):
      last_idx = i
    kv_source = None if mode == "swa" else last_kv
    index_source = None if mode == "swa" else last_idx
    if mode != "swa":
      if kv_source is None:
        raise ConfigError(
            f"layer {i} (compress_ratios[{i}] = {m}) is a CSA2 {mode} layer but no earlier layer in "
            f"kv_source_layer_ids {list(cfg.kv_source_layer_ids)} provides its KV")
      if cfg.compress_ratios[kv_source] != m:
        raise ConfigError(
            f"layer {i} reads the KV of layer {kv_source} (kv_source_layer_ids) but their "
            f"compress_ratios differ ({m} vs {cfg.compress_ratios[kv_source]})")
      if (kv_source < n_enc) != (i < n_enc):
        raise ConfigError(
            f"layer {i} would read the KV of layer {kv_source} across the encoder/decoder boundary "
            f"(layer {n_enc}); add a decoder layer to kv_source_layer_ids")
    candidate_role = None
    if cfg.use_candidate_pool and mode != "swa":
      src = cfg.candidate_source_layer_id
      if i == src:
        candidate_role = "source"
      elif mode == "reindex" and i > src and kv_source == cfg.kv_source_layer_ids[
          max(j for j, k in enumerate(cfg.kv_source_layer_ids) if k <= src)]:
        candidate_role = "consumer"
    kv_input = None
    if mode == "full":
      kv_input = "encoder_final" if (cfg.kv_source_input == "encoder_final" and i >= n_enc) else "own"
    theta = cfg.rope_theta if m == 0 else cfg.compress_rope_theta
    specs.append(LayerSpec(
        index=i, compress_ratio=m, mode=mode, kv_source=kv_source, index_source=index_source,
        engram=i in cfg.engram_layer_ids, candidate_role=candidate_role, is_encoder=i < n_enc,
        kv_input=kv_input, rope_theta=theta, yarn=cfg.yarn_enabled and m != 0))
  return LayerPlan(layers=tuple(specs), segments=_segments(specs), num_encoder_layers=n_enc)


def _units(specs: list[LayerSpec]) -> list[tuple[LayerSpec, ...]]:
  units: list[list[LayerSpec]] = []
  for s in specs:
    starts_unit = (s.mode in ("swa", "full", "reindex") or not units
                   or units[-1][0].mode == "swa" or s.is_encoder != units[-1][0].is_encoder)
    if starts_unit:
      units.append([s])
    else:
      units[-1].append(s)
  return [tuple(u) for u in units]


def _segments(specs: list[LayerSpec]) -> tuple[Segment, ...]:
  segments: list[Segment] = []
  for unit in _units(specs):
    sig = tuple(s.structure() for s in unit)
    # Engram tables differ in size from layer to layer (distinct primes), so they never stack.
    if segments and not any(s.engram for s in unit):
      prev = segments[-1]
      if tuple(s.structure() for s in prev.unit) == sig:
        segments[-1] = dataclasses.replace(prev, repeats=prev.repeats + 1)
        continue
    segments.append(Segment(first_layer=unit[0].index, unit=unit, repeats=1))
  return tuple(segments)
