"""The analytic per-device memory plan of the train step for a mesh (docs/design.md §T1): pure
functions of the config, the mesh and the sharding rules, nothing compiled. `launch.aot` prints it
and sets it beside XLA's memory analysis of the compiled step.

From shapes and shardings alone, per device,
  parameters   Σ_leaves Π_d ⌈n_d / ways_d⌉ · itemsize(param_dtype), ways_d = product of the mesh
               axes that dimension d is split over,
  gradients    the same (gradients take their parameters' dtype and sharding); twice that with
               gradient accumulation (`train.grad_accum_steps` = k > 1: the accumulator and one
               micro-batch's gradients),
  optimizer    Σ_leaves buffers(group) · the same, buffers = 1 for muon / sinkhorn, 2 for adamw,
               and 2 for every group under `optim.chain = "adamw"` (`optim.table.state_buffers`;
               groups from `optim.table.label_params`),
  activations  an estimate (`activation_bytes`), whose formula is in that function's docstring.
The batch is split over the mesh axes of the logical axis "batch"; b = global batch / those ways,
and the activations are those of one micro-batch, b / k rows.

Mesh and rules come as text (`parse_mesh`, `parse_rules`: the `--mesh` and `--rules` of
`launch.aot`); `parse_rules` overrides entries of `sharding.RULES`. A table that leaves a
parameter's logical axis unmapped, maps a mesh axis twice within a parameter, or splits a dimension
the mesh cannot divide is a `PlanError` naming the parameter (and the dimension and axis).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv41_jax import model as model_lib, sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers import attention as attention_lib
from optim import table as table_lib
from pallas_kernels import dispatch


class PlanError(ValueError):
  """Bad mesh, rules or batch for a plan; the message says what to change."""


# --- inputs: mesh, rules, batch -----------------------------------------------------------------

def parse_mesh(text: str) -> dict[str, int]:
  """'data:8,expert:4' → {'data': 8, 'expert': 4}; axes from `sharding.MESH_AXES`, one may be -1."""
  out: dict[str, int] = {}
  for part in (p.strip() for p in text.split(",")):
    if not part:
      continue
    name, sep, size = part.partition(":")
    name = name.strip()
    if not sep:
      raise PlanError(f"mesh entry {part!r} is not AXIS:SIZE (e.g. --mesh=data:8,expert:4)")
    if name not in sharding.MESH_AXES:
      raise PlanError(f"unknown mesh axis {name!r} in {text!r}; the mesh axes are "
                      f"{', '.join(sharding.MESH_AXES)}")
    if name in out:
      raise PlanError(f"mesh axis {name!r} given twice in {text!r}")
    try:
      n = int(size)
    except ValueError:
      raise PlanError(f"mesh axis {name!r} has size {size!r}, not an integer") from None
    if n < 1 and n != -1:
      raise PlanError(f"mesh axis {name!r} has size {n}; sizes are positive (or one -1)")
    out[name] = n
  if not out:
    raise PlanError("empty mesh; give e.g. --mesh=data:8,expert:4")
  if list(out.values()).count(-1) > 1:
    raise PlanError(f"at most one mesh axis may be -1 in {text!r}")
  return out


def resolve_mesh(shape: Mapping[str, int], n_devices: int | None) -> dict[str, int]:
  """Every MESH_AXES size (missing = 1, a -1 takes the rest); checks the product == n_devices."""
  sizes = {a: int(shape.get(a, 1)) for a in sharding.MESH_AXES}
  fixed = math.prod(s for s in sizes.values() if s != -1)
  free = [a for a, s in sizes.items() if s == -1]
  if free:
    if n_devices is None:
      raise PlanError(f"mesh axis {free[0]!r} is -1: give --devices so its size is known")
    if n_devices % fixed:
      raise PlanError(f"the fixed mesh axes multiply to {fixed}, which does not divide the "
                      f"{n_devices} devices")
    sizes[free[0]] = n_devices // fixed
  total = math.prod(sizes.values())
  if n_devices is not None and total != n_devices:
    raise PlanError(f"mesh {mesh_str(sizes)} has {total} positions but there are {n_devices} "
                    f"devices; change the axis sizes so their product is {n_devices}")
  return sizes


def mesh_str(sizes: Mapping[str, int]) -> str:
  return ",".join(f"{a}:{s}" for a, s in sizes.items() if s != 1) or "(1 device)"


def parse_rules(text: str | None, base=None) -> dict[str, Any]:
  """`base` (default `sharding.RULES`) with overrides 'logical=axis+axis;logical2=none' (none =
  replicated)."""
  rules = dict(sharding.RULES if base is None else base)
  if not text:
    return rules
  for part in (p.strip() for p in text.split(";")):
    if not part:
      continue
    name, sep, target = part.partition("=")
    name = name.strip()
    if not sep or name not in rules:
      raise PlanError(f"rule {part!r}: expected LOGICAL=AXIS[+AXIS...] with LOGICAL one of the "
                      f"logical axes in dsv41_jax.sharding.RULES")
    axes = tuple(t.strip() for t in target.split("+") if t.strip())
    if axes in ((), ("none",)):
      rules[name] = None
      continue
    bad = [a for a in axes if a not in sharding.MESH_AXES]
    if bad:
      raise PlanError(f"rule {part!r}: unknown mesh axes {bad}; the mesh axes are "
                      f"{', '.join(sharding.MESH_AXES)}")
    rules[name] = axes[0] if len(axes) == 1 else axes
  try:
    return sharding.check_table(rules)
  except sharding.ShardingError as e:
    raise PlanError(str(e)) from None


def batch_ways(sizes: Mapping[str, int], rules: Mapping[str, Any]) -> tuple[tuple[str, ...], int]:
  """The mesh axes the batch is split over and their product (`sharding.batch_axes`)."""
  return sharding.batch_axes(sizes, rules), sharding.batch_ways(sizes, rules)


def global_batch_for(requested: int | None, per_config: int, ways: int) -> tuple[int, str]:
  """The global batch: `requested` (which must split over `ways`), else the config's batch
  rounded up to a multiple of `ways` (with a note saying so)."""
  if requested is not None:
    if requested < 1 or requested % ways:
      raise PlanError(f"--batch={requested} does not split over the mesh's {ways} batch shards; "
                      f"use a positive multiple of {ways}")
    return requested, ""
  b = -(-per_config // ways) * ways
  note = "" if b == per_config else (f" (config batch {per_config} rounded up to a multiple of the "
                                     f"{ways} batch shards)")
  return b, note


# --- analytic plan ------------------------------------------------------------------------------

def _spec_ways(spec: P, sizes: Mapping[str, int]) -> list[int]:
  return [sharding.axes_size(sizes, () if e is None else ((e,) if isinstance(e, str) else e))
          for e in spec]


def param_shards(cfg: ModelConfig, sizes: Mapping[str, int], rules=None):
  """(path, shape, PartitionSpec, per-device elements, optimizer group) for every parameter.

  Raises `PlanError` naming the parameter (and dimension and axis) that the rules or the mesh
  cannot partition.
  """
  state = model_lib.abstract_params(cfg)
  try:
    specs = sharding.state_partition_specs(state, rules)
  except sharding.ShardingError as e:
    raise PlanError(str(e)) from None
  mesh_axes = {a for a, s in sizes.items() if s > 1}
  groups = {p: r.group for p, r in table_lib.label_params(state).items()}
  spec_by_path = dict(table_lib.flatten_params(specs))
  out = []
  for path, leaf in table_lib.flatten_params(state):
    spec = spec_by_path[path]
    spec = P(*(_keep_axes(e, mesh_axes) for e in spec))
    try:
      sharding.check_divisible(tuple(leaf.shape), spec, sizes, path)
    except sharding.ShardingError as e:
      raise PlanError(str(e)) from None
    ways = _spec_ways(spec, sizes)
    local = math.prod(n // w for n, w in zip(leaf.shape, ways))
    out.append((path, tuple(leaf.shape), spec, local, groups[path]))
  return out


def _keep_axes(entry, names):
  if entry is None:
    return None
  kept = tuple(e for e in ((entry,) if isinstance(entry, str) else entry) if e in names)
  return kept if len(kept) > 1 else (kept[0] if kept else None)


# Live float32 buffers of a layer's score size ([b, H, T, N] global scores, [b, 512, H_I, N]
# indexer logits) while the recomputed layer runs its backward: scores, mask, probabilities and
# their cotangents. Measured, not derived: XLA's memory analysis of the micro model's gradient
# step (configs/tiny.py:micro, data 2 × fsdp 2, batch 8, remat) under the CPU schedule that
# `launch.train` and the test suite use (depth-first) at T = 128, 256, 512 leaves 4.9, 4.2 and
# 4.0 copies beside the other terms (2026-12-05; 5 fitted the breadth-first schedule of
# 2026-11-30); checked at other shapes by tests/launch/test_memory_plan.py.
SCORE_COPIES = 4

# The kernels whose score-sized buffers stay on chip: with them a layer keeps no [T, N] scores
# (`pallas_kernels.dispatch`, the ops `sparse_attention` and `indexer_topk`).
ATTENTION_KERNEL = "pallas_kernels.csa2_attention:sparse_attend"
INDEXER_KERNEL = "pallas_kernels.indexer:indexer_topk"


def kernels_taken(cfg: ModelConfig, spec, b: int, T: int, backend: str) -> tuple[bool, bool]:
  """(attention, indexer): whether the config's op policies run the on-chip kernel for this
  layer's global attention and its indexer on `backend`, decided by the dispatcher's own rules
  on the shapes the layer gives them (`dispatch.implementation`)."""
  if not spec.compress_ratio:
    return False, False
  sd, dt = jax.ShapeDtypeStruct, jnp.dtype(cfg.dtype)
  H, Dh, n_ent = cfg.num_attention_heads, cfg.head_dim, spec.entries(T)
  K = min(cfg.index_topk, n_ent)
  seg = sd((b, T), jnp.int32)
  attention = dispatch.implementation(
      "sparse_attention", cfg.ops.sparse_attention, sd((b, T, H, Dh), dt), sd((b, T, Dh), dt),
      seg, sd((H,), jnp.float32), sd((b, n_ent, Dh), dt), sd((b, T, K), jnp.int32),
      backend=backend, **attention_lib.op_static(cfg)) == ATTENTION_KERNEL
  indexer = False
  if spec.owns_indexer:
    HI, I = cfg.index_n_heads, cfg.index_head_dim
    pool = spec.candidate_role == "consumer"
    indexer = dispatch.implementation(
        "indexer_topk", cfg.ops.indexer_topk, sd((b, T, HI, I), dt), sd((b, T, HI), jnp.float32),
        sd((b, n_ent, I), dt), sd((b, n_ent), jnp.int32), sd((b, n_ent), jnp.int32), seg,
        sd((b, T, 1), jnp.int32) if pool else None, backend=backend, k=cfg.index_topk,
        make_pool=spec.candidate_role == "source",
        query_chunk=cfg.index_query_chunk or None) == INDEXER_KERNEL
  return attention, indexer


def activation_bytes(cfg: ModelConfig, b: int, T: int, sizes: Mapping[str, int],
                     backend: str | None = None) -> dict[str, float]:
  """Estimated activation bytes per device for b rows of T tokens (an estimate, not a measurement)
  of the step compiled for `backend` ("gpu", "cpu", "tpu"; None: this process's jax backend),
  whose op policies (`cfg.ops`) may take kernels there that keep no score-sized buffers.

  With layer remat (cfg.remat) every layer keeps only its input carry for the backward pass; the
  largest layer is then recomputed with all its intermediates live, values and their cotangents
  both. Terms (a = itemsize of cfg.dtype, tp = the tensor axis size, N = hc_mult):
    carries      (L + 1) · b·T·(N·D·s + p)                residual streams saved per layer
                 (s = itemsize of cfg.hc_stream_dtype: 4, or 2 for bfloat16 streams; p = D·a
                 + 4·N·(N + 1), the pending MoE output and its site's coefficients, with
                 `single_pass_boundary`, else 0)
                 (without remat: every layer's working set below is kept instead)
    layer work   max over layers of 2·(attention + moe + mhc) + SCORE_COPIES·scores, per layer
      attention  b·T·(H/tp)·Dh·a  (q)  +  b·(H/tp)·T·(P+1)·S·4  (window scores, S = min(W, T),
                 P = ⌈(W−1)/S⌉ previous blocks)  +  "gather" global branch
                 b·T·K·Dh·a + b·(H/tp)·T·K·4; where the attention kernel runs (`kernels_taken`): b·T·(H/tp)·(2·Dh·a + 4)
                 (q, the output and its log-sum-exp: window and entries are scored on chip)
      scores     "masked" global scores b·(H/tp)·T·⌈T/m⌉·4, not where the attention kernel runs
                 + indexer b·min(512, T)·H_I·⌈T/m⌉·4, not where the indexer kernel runs
                 (SCORE_COPIES live copies: measured, see the constant)
      moe        b·T·k·(D + 3·I/tp)·a + b·T·k·D·o     (sorted pairs, gate/up/act, the outputs:
                                                       o = 4, or a with moe_product_dtype "compute")
      mhc        4 · b·T·N·D·4                         (pre/post mixes of the streams, f32)
    logits       3 · n·(V/tp)·4                        (f32 logits, softmax, their gradient;
                                                       n = b·T, or min(b·T, lm_loss_chunk) tokens
                                                       at a time with `lm_loss_chunk`)
  """
  backend = backend or jax.default_backend()
  a = jnp.dtype(cfg.dtype).itemsize
  tp = sizes.get("tensor", 1)
  D, N, H, Dh = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
  Ht = -(-H // tp)
  plan = build_layer_plan(cfg)
  stream = b * T * N * D * 4
  stored = b * T * N * D * jnp.dtype(cfg.hc_stream_dtype).itemsize
  if cfg.single_pass_boundary and cfg.residual == "mhc":
    stored += b * T * (D * a + 4 * N * (N + 1))      # the carry's pending output (block.StreamState)
  S = min(cfg.sliding_window, T)
  prev = -(-(cfg.sliding_window - 1) // S)

  def layer(spec) -> tuple[float, float]:
    attention_kernel, indexer_kernel = kernels_taken(cfg, spec, b, T, backend)
    if attention_kernel:
      att = b * T * Ht * (2 * Dh * a + 4)
    else:
      att = b * T * Ht * Dh * a + b * Ht * T * (prev + 1) * S * 4
    scores = 0.0
    if spec.compress_ratio:
      n_ent = spec.entries(T)
      K = min(cfg.index_topk, n_ent)
      if attention_kernel:      # window and entries scored on chip: nothing more per entry
        pass
      elif cfg.global_attn_impl == "masked":
        scores += b * Ht * T * n_ent * 4
      else:
        att += b * T * K * Dh * a + b * Ht * T * K * 4
      if spec.owns_indexer and not indexer_kernel:
        scores += b * min(512, T) * cfg.index_n_heads * n_ent * 4
    k, I = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    o = a if cfg.moe_product_dtype == "compute" else 4
    moe = b * T * k * (D + 3 * -(-I // tp)) * a + b * T * k * D * o
    return att + moe + 4 * stream, scores

  per_layer = [2 * lin + SCORE_COPIES * sc for lin, sc in map(layer, plan.layers)]
  if cfg.remat:
    carries = (len(per_layer) + 1) * stored
    work = max(per_layer)
  else:
    carries = 0.0
    work = sum(per_layer)
  tokens = min(b * T, cfg.lm_loss_chunk) if cfg.lm_loss_chunk else b * T
  logits = 3 * tokens * -(-cfg.vocab_size // tp) * 4
  return {"carries": float(carries), "layer_work": float(work), "logits": float(logits),
          "total": float(carries + work + logits)}


def analytic_plan(cfg: ModelConfig, sizes: Mapping[str, int], global_batch: int, seq_len: int,
                  rules=None, chain: str = "muon", grad_accum_steps: int = 1,
                  backend: str | None = None) -> dict[str, Any]:
  """Per-device bytes of parameters, gradients, optimizer state and activations (see module doc)
  of the step compiled for `backend` (None: this process's jax backend; `activation_bytes`)."""
  k = grad_accum_steps
  rules = dict(sharding.active_rules() if rules is None else rules)
  rows = param_shards(cfg, sizes, rules)
  item = jnp.dtype(cfg.param_dtype).itemsize
  params = sum(r[3] for r in rows) * item
  opt = sum(table_lib.state_buffers(r[4], chain) * r[3] for r in rows) * item
  axes, ways = batch_ways(sizes, rules)
  if k < 1:
    raise PlanError(f"train.grad_accum_steps={k} must be >= 1")
  if global_batch % (k * ways):
    raise PlanError(f"global batch {global_batch} does not split into train.grad_accum_steps "
                    f"({k}) micro-batches over the {ways} batch shards {axes}; make it a multiple "
                    f"of {k * ways}")
  b = global_batch // ways
  backend = backend or jax.default_backend()
  act = activation_bytes(cfg, b // k, seq_len, sizes, backend)
  grads = params * (2 if k > 1 else 1)
  by_group: dict[str, float] = {}
  for r in rows:
    by_group[r[4]] = by_group.get(r[4], 0.0) + r[3] * item
  return {
      "mesh": dict(sizes), "global_batch": global_batch, "rows_per_device": b,
      "seq_len": seq_len, "batch_axes": axes, "backend": backend,
      "total_params": sum(math.prod(r[1]) for r in rows),
      "grad_accum_steps": k,
      "param_bytes": float(params), "grad_bytes": float(grads), "opt_bytes": float(opt),
      "param_bytes_by_group": by_group,
      "activation_bytes": act,
      "total_bytes": float(params + grads + opt + act["total"]),
      "axes_use": axis_use(rows, sizes),
      "rules": rules_used(rules, sizes),
  }


def rules_used(rules: Mapping[str, Any], sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
  """The rules that split something on this mesh: logical axis -> its mesh axes of size > 1."""
  out = {}
  for name in rules:
    axes = sharding.mesh_axes(sizes, name, rules)
    if axes:
      out[name] = axes
  return out


def axis_use(rows, sizes: Mapping[str, int]) -> dict[str, str]:
  """For each mesh axis of size > 1: the parameter families it splits (and whether the batch)."""
  fam: dict[str, set[str]] = {a: set() for a, s in sizes.items() if s > 1}
  for path, _, spec, _, _ in rows:
    for entry in spec:
      for n in () if entry is None else ((entry,) if isinstance(entry, str) else entry):
        if n in fam:
          fam[n].add(_family(path))
  return {a: ", ".join(sorted(f)) or "(no parameters)" for a, f in fam.items()}


def _family(path: str) -> str:
  parts = [p for p in path.split("/") if not p.isdigit() and p not in ("runs", "core")]
  return "/".join(parts[-2:]) if len(parts) > 1 else parts[0]
