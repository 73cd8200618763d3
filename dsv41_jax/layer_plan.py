"""The static layer plan of docs/design.md §2, computed once from a `ModelConfig`, as data.

Each layer gets a `LayerSpec` (its compression ratio, CSA2 mode, KV and index sources, Engram
flag, candidate role, RoPE base). Consecutive layers are then grouped into *runs* that one
`lax.scan` executes with one compiled layer body:

- a run never crosses the encoder/decoder boundary, nor a change of compression ratio (the shared
  compressed KV in the scan's carry keeps one shape), and an Engram layer always starts one: its
  table lookup and gated injection run before the run's scan, on the streams the scan starts
  from, so tables of different sizes never need stacking, the scan body holds no Engram branch
  and no run's stacks are sliced around the injection;
- inside a run, layers differ only by their *kind* (`LayerSpec.kind`: Full, Reindex, Reuse, SWA,
  with their candidate-pool role and KV input). The scan body switches on the kind (`lax.switch`),
  so the program holds one body per kind per run, and the number of runs is fixed by the two
  halves, the ratio changes and the Engram layers, not by depth.

The model, the ledger and the tests all read this table; no model code tests a layer index.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, TYPE_CHECKING

from dsv41_jax.errors import ConfigError

if TYPE_CHECKING:  # the config builds its plan at validation: a runtime import would be a circle
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
  # A decoder KV source whose compressed KV the encoder-only prefill (CED, docs/design.md §6)
  # projects from the final encoder state H_{L/2}: a decoder Full layer reading H_{L/2}
  # (`kv_input` "encoder_final"), or the first decoder layer, whose own input H_{L/2} is.
  prefills_from_encoder: bool

  def structure(self) -> tuple:
    """Everything that shapes the layer's computation graph, without its position in the stack."""
    return (self.compress_ratio, self.mode, self.engram, self.candidate_role, self.kv_input,
            self.rope_theta, self.yarn, self.is_encoder)

  @property
  def kind(self) -> tuple:
    """What a run's scan body switches on: mode, candidate role and KV input."""
    return (self.mode, self.candidate_role, self.kv_input)

  @property
  def kind_name(self) -> str:
    """The kind as a parameter-path component: `full`, `reindex_consumer`, `full_encfinal`, …"""
    parts = [self.mode, self.candidate_role or "", "encfinal" if self.kv_input == "encoder_final"
             else ""]
    return "_".join(p for p in parts if p)

  @property
  def owns_compressor(self) -> bool:
    return self.mode == "full"

  @property
  def owns_indexer(self) -> bool:
    return self.mode in ("full", "reindex")

  @property
  def reads_global_kv(self) -> bool:
    return self.mode != "swa"

  def entries(self, T: int) -> int:
    """Compressed KV entries this layer reads for a row of T tokens: ⌈T / m⌉ (the row zero-padded
    to whole blocks of its compress ratio m, docs/design.md §5.2); 0 for a sliding-window layer."""
    return -(-T // self.compress_ratio) if self.reads_global_kv else 0


@dataclasses.dataclass(frozen=True)
class Run:
  """Consecutive layers executed by one scan (see the module docstring).

  `kinds` holds one representative spec per distinct `LayerSpec.kind`, in order of first
  appearance; `kind_of[i]` is layer i's index into `kinds` and `slot_of[i]` its index among the
  run's layers of that kind (the row of the kind's stacked parameters it uses).
  """

  layers: tuple[LayerSpec, ...]
  kinds: tuple[LayerSpec, ...]
  kind_of: tuple[int, ...]
  slot_of: tuple[int, ...]

  @property
  def first_layer(self) -> int:
    return self.layers[0].index

  @property
  def n_layers(self) -> int:
    return len(self.layers)

  @property
  def compress_ratio(self) -> int:
    return self.layers[0].compress_ratio

  @property
  def is_encoder(self) -> bool:
    return self.layers[0].is_encoder

  @property
  def engram(self) -> bool:
    """The run's first layer injects Engram memory (an Engram layer always starts a run)."""
    return self.layers[0].engram

  @property
  def engram_layer(self) -> int | None:
    return self.first_layer if self.engram else None

  def kind_count(self, k: int) -> int:
    return self.kind_of.count(k)

  def layers_of_kind(self, k: int) -> tuple[int, ...]:
    return tuple(l.index for l, j in zip(self.layers, self.kind_of) if j == k)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  layers: tuple[LayerSpec, ...]
  runs: tuple[Run, ...]
  num_encoder_layers: int

  def __iter__(self):
    return iter(self.layers)

  def __len__(self):
    return len(self.layers)

  def __getitem__(self, i: int) -> LayerSpec:
    return self.layers[i]

  def run_of(self, layer: int) -> tuple[int, int]:
    """(run index, position within the run) of a layer."""
    for r, run in enumerate(self.runs):
      if run.first_layer <= layer < run.first_layer + run.n_layers:
        return r, layer - run.first_layer
    raise IndexError(f"layer {layer} is not in the plan ({len(self.layers)} layers)")

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
        kv_input=kv_input, rope_theta=theta, yarn=cfg.yarn_enabled and m != 0,
        prefills_from_encoder=mode == "full" and (kv_input == "encoder_final" or i == n_enc)))
  return LayerPlan(layers=tuple(specs), runs=_runs(specs), num_encoder_layers=n_enc)


def _runs(specs: list[LayerSpec]) -> tuple[Run, ...]:
  groups: list[list[LayerSpec]] = []
  for s in specs:
    starts_run = (not groups or s.is_encoder != groups[-1][0].is_encoder
                  or s.compress_ratio != groups[-1][0].compress_ratio or s.engram)
    if starts_run:
      groups.append([s])
    else:
      groups[-1].append(s)
  runs = []
  for g in groups:
    kinds: list[LayerSpec] = []
    kind_of, slot_of = [], []
    for s in g:
      k = next((i for i, r in enumerate(kinds) if r.kind == s.kind), None)
      if k is None:
        k = len(kinds)
        kinds.append(s)
      slot_of.append(kind_of.count(k))
      kind_of.append(k)
    runs.append(Run(layers=tuple(g), kinds=tuple(kinds), kind_of=tuple(kind_of),
                    slot_of=tuple(slot_of)))
  return tuple(runs)
