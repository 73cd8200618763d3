"""The one declarative table: parameter-path pattern -> optimizer group (docs/design.md §T2).

Parameters are named by their '/'-joined path in the parameter tree
(`runs/0/core/attn/wq_b`, see the naming note of the model). A pattern is matched against
the whole path: `*` matches within one path component, `**` matches any number of whole components
(none included), `{a,b}` matches either alternative. Patterns never look at rank, because the
scanned runs carry extra leading stacked axes on every leaf.

Every parameter must be claimed by exactly one row (`label_params` raises `TableError` naming every
parameter claimed by no row or by several), and every row must claim something in at least one
model config (`check_rows_used`).

Groups: `muon` (matrices; `headwise=True` for query weights stored `(in, heads, head_dim)`),
`adamw` (norms, sinks, mHC base/scale, Engram gate weights), `sinkhorn` (embedding, output head,
Engram tables). Per-row `lr_mult` multiplies that row's learning rate (Engram tables ×5, docs/design.md
§7.4); `tag` gives such a row its own entry in the logged learning rates.

The vision pathway (`vision/...` ViT, `projector/...`): every ViT row carries `tag="vision"`, whose
learning rate is further multiplied by `OptimConfig.vision_lr_mult` (the ViT joins at a smaller
learning rate once unfrozen); the projector trains like the backbone. ViT norms are claimed by their
own row, so the generic norm row is split into the backbone (`runs/`, `projector/`) and
`final_norm`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from pallas_kernels.ops.paths import path_str

GROUPS: tuple[str, ...] = ("muon", "adamw", "sinkhorn")
# Optimizer-state buffers each group keeps per parameter element (momentum; Adam's two moments).
STATE_BUFFERS: Mapping[str, int] = {"muon": 1, "adamw": 2, "sinkhorn": 1}


def state_buffers(group: str, chain: str = "muon") -> int:
  """Buffers per element that `group` keeps under `OptimConfig.chain`: with "adamw" every group is
  AdamW (two moments)."""
  return STATE_BUFFERS["adamw"] if chain == "adamw" else STATE_BUFFERS[group]


class TableError(ValueError):
  """A parameter tree and the optimizer table disagree; the message names the paths or rows."""


@dataclasses.dataclass(frozen=True)
class Row:
  pattern: str
  group: str
  headwise: bool = False    # muon only: orthogonalize each head of an (in, heads, head_dim) weight
  lr_mult: float = 1.0
  tag: str | None = None    # name of this row's own learning-rate entry (rows with lr_mult != 1)

  def __post_init__(self):
    if self.group not in GROUPS:
      raise TableError(f"row {self.pattern!r}: unknown group {self.group!r} (groups: {GROUPS})")
    if self.headwise and self.group != "muon":
      raise TableError(f"row {self.pattern!r}: headwise applies to the muon group only")
    _compile(self.pattern)

  def matches(self, path: str) -> bool:
    return _compile(self.pattern).fullmatch(path) is not None


@functools.lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern:
  """Translate a path pattern into a regular expression over '/'-joined paths."""
  if not pattern or pattern.startswith("/") or pattern.endswith("/"):
    raise TableError(f"bad path pattern {pattern!r}")
  out: list[str] = []
  parts = pattern.split("/")
  for i, part in enumerate(parts):
    last = i == len(parts) - 1
    if part == "**":
      out.append(".*" if last else "(?:[^/]+/)*")
      continue
    out.append(_component(part, pattern) + ("" if last else "/"))
  return re.compile("".join(out))


def _component(part: str, pattern: str) -> str:
  rx, i = [], 0
  while i < len(part):
    ch = part[i]
    if ch == "*":
      rx.append("[^/]*")
    elif ch == "{":
      j = part.find("}", i)
      if j < 0:
        raise TableError(f"unclosed '{{' in path pattern {pattern!r}")
      rx.append("(?:" + "|".join(_component(a, pattern) for a in part[i + 1:j].split(",")) + ")")
      i = j
    elif ch == "}":
      raise TableError(f"bad path pattern {pattern!r}")
    else:
      rx.append(re.escape(ch))
    i += 1
  return "".join(rx)


# The table. Rows are disjoint by construction; `label_params` proves it on every tree it sees.
TABLE: tuple[Row, ...] = (
    # --- sinkhorn: token embedding, output head, Engram tables (one 2-D parameter per layer,
    #     balanced per (order, head) sub-table given `build_optimizer`'s `sub_tables`) ---
    Row("embed", "sinkhorn"),
    Row("head", "sinkhorn"),
    Row("**/engram/table", "sinkhorn", lr_mult=5.0, tag="engram_table"),
    # --- muon, head-wise: query up-projections stored (q_lora, heads, head_dim) ---
    Row("**/attn/wq_b", "muon", headwise=True),
    Row("**/indexer/wq_b", "muon", headwise=True),
    # --- muon, vanilla: every other matrix (leading expert / group / layer axes are batch axes) ---
    Row("**/attn/{wq_a,wkv,wo_a,wo_b}", "muon"),
    Row("**/compressor/{wkv,wgate}", "muon"),
    Row("**/indexer/{weights_proj,wk}", "muon"),
    Row("**/moe/router", "muon"),
    Row("**/moe/{experts,shared}/{w1,w2,w3}", "muon"),
    Row("**/engram/w_ekv", "muon"),
    Row("**/{attn_hc,ffn_hc}/fn", "muon"),
    # --- adamw: norms, sinks, mHC base / scale, Engram gate weights (RMSNorm weights, docs/design.md §7.3)
    Row("{runs,projector}/**/*norm/scale", "adamw"),
    Row("final_norm/scale", "adamw"),
    Row("**/attn/attn_sink", "adamw"),
    Row("**/{attn_hc,ffn_hc}/{base,scale}", "adamw"),
    Row("**/engram/{q_w,k_w}", "adamw"),
    # --- vision pathway: the ViT (its own lr multiplier, frozen until the decay) and projector ---
    Row("vision/patch_embed", "muon", tag="vision"),
    Row("vision/layers/attn/{wq,wk,wv,wo}", "muon", tag="vision"),
    Row("vision/layers/mlp/{w1,w2,w3}", "muon", tag="vision"),
    Row("vision/**/*norm/scale", "adamw", tag="vision"),
    Row("projector/{w1,w2}", "muon"),
)


# --- paths: a parameter's name is `dsv41_jax.param_paths.path_str` of its key path -------------

def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _shape(leaf) -> tuple[int, ...]:
  return tuple(getattr(leaf, "shape", np.shape(leaf)))


def _leaf_value(x):
  return x.get_value() if _is_variable(x) else x


def flatten_params(params) -> list[tuple[str, Any]]:
  """(path, leaf) for every parameter; nnx.Variables are unwrapped to their value."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)
  return [(path_str(p), _leaf_value(v)) for p, v in flat]


def map_params(fn, params):
  """`fn(path, leaf) -> x` on every parameter, keeping the tree (Variables count as leaves)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, v: fn(path_str(p), _leaf_value(v)), params, is_leaf=_is_variable)


# --- labelling --------------------------------------------------------------------------------

def rows_for(path: str, table: Sequence[Row] = TABLE) -> list[Row]:
  return [r for r in table if r.matches(path)]


def label_params(params, table: Sequence[Row] = TABLE) -> dict[str, Row]:
  """path -> the one table row that claims it; `TableError` names every unclaimed or doubly
  claimed parameter, and every parameter a row cannot handle (rank too small)."""
  unclaimed, doubled, bad_rank = [], [], []
  out: dict[str, Row] = {}
  for path, leaf in flatten_params(params):
    rows = rows_for(path, table)
    if not rows:
      unclaimed.append(path)
      continue
    if len(rows) > 1:
      doubled.append(f"{path} (rows {[r.pattern for r in rows]})")
      continue
    row = rows[0]
    need = 3 if row.headwise else (2 if row.group in ("muon", "sinkhorn") else 0)
    if len(_shape(leaf)) < need:
      bad_rank.append(f"{path} (shape {_shape(leaf)}, row {row.pattern!r} needs rank >= {need})")
    out[path] = row
  msgs = []
  if unclaimed:
    msgs.append(f"parameters claimed by no table row: {unclaimed}")
  if doubled:
    msgs.append(f"parameters claimed by several table rows: {doubled}")
  if bad_rank:
    msgs.append(f"parameters whose rank their row cannot handle: {bad_rank}")
  if msgs:
    raise TableError("; ".join(msgs))
  return out


def check_sub_tables(sub_tables: Mapping[str, Sequence[tuple[int, int]]], rows: Mapping[str, Row],
                     shapes: Mapping[str, tuple[int, ...]]
                     ) -> dict[str, tuple[tuple[int, int], ...]]:
  """The sub-table layouts as tuples of (offset, rows) along axis −2, after checking that each
  names a sinkhorn-group parameter and that its blocks are ascending, disjoint and inside the
  parameter's rows; `TableError` names every bad entry."""
  out, bad = {}, []
  for path, blocks in sub_tables.items():
    blocks = tuple((int(o), int(n)) for o, n in blocks)
    if path not in rows:
      bad.append(f"{path} (no such parameter)")
      continue
    if rows[path].group != "sinkhorn":
      bad.append(f"{path} (group {rows[path].group!r}, only sinkhorn balances sub-tables)")
      continue
    ends = [0] + [o + n for o, n in blocks]
    if not blocks or any(n <= 0 or o < e for (o, n), e in zip(blocks, ends)) or (
        ends[-1] > shapes[path][-2]):
      bad.append(f"{path} (blocks {blocks} not ascending, disjoint and within "
                 f"{shapes[path][-2]} rows)")
      continue
    out[path] = blocks
  if bad:
    raise TableError(f"bad sub-table layouts: {bad}")
  return out


def label_tree(params, table: Sequence[Row] = TABLE):
  """The params tree with each parameter replaced by its group name (for `optax.partition`)."""
  rows = label_params(params, table)
  return map_params(lambda path, _: rows[path].group, params)


def check_rows_used(param_trees: Iterable[Any], table: Sequence[Row] = TABLE) -> None:
  """`TableError` naming every row that matches no parameter in any of the given trees."""
  paths = [p for tree in param_trees for p, _ in flatten_params(tree)]
  unused = [r.pattern for r in table if not any(r.matches(p) for p in paths)]
  if unused:
    raise TableError(f"table rows matching no parameter in any config: {unused}")


def check_patterns_used(patterns: Iterable[str], params, what: str) -> None:
  """`TableError` naming every pattern (e.g. of frozen parameters) that matches no parameter."""
  paths = [p for p, _ in flatten_params(params)]
  unused = [pat for pat in patterns if not any(_compile(pat).fullmatch(p) for p in paths)]
  if unused:
    raise TableError(f"{what} patterns matching no parameter: {unused}")


def matches_any(path: str, patterns: Iterable[str]) -> bool:
  return any(_compile(p).fullmatch(path) for p in patterns)


# --- report -----------------------------------------------------------------------------------

def state_bytes(leaf, group: str) -> int:
  """Bytes of optimizer state the group keeps for this parameter (buffers in the param dtype)."""
  return int(np.prod(_shape(leaf))) * np.dtype(leaf.dtype).itemsize * STATE_BUFFERS[group]


def report(params, table: Sequence[Row] = TABLE) -> str:
  """A printable table: parameter path, shape, group (+ options), optimizer-state bytes."""
  rows = label_params(params, table)
  lines = [f"{'parameter':60s} {'shape':28s} {'group':18s} {'state bytes':>16s}"]
  totals = {g: [0, 0] for g in GROUPS}
  for path, leaf in flatten_params(params):
    row = rows[path]
    group = row.group + (" headwise" if row.headwise else "") + (
        f" lr×{row.lr_mult:g}" if row.lr_mult != 1 else "")
    nbytes = state_bytes(leaf, row.group)
    totals[row.group][0] += int(np.prod(leaf.shape))
    totals[row.group][1] += nbytes
    lines.append(f"{path:60s} {str(tuple(leaf.shape)):28s} {group:18s} {nbytes:16,d}")
  lines.append("")
  for g, (n, b) in totals.items():
    lines.append(f"{g:8s} {n:20,d} parameters {b:20,d} state bytes")
  return "\n".join(lines)
