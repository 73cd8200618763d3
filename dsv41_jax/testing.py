"""Unit-testing sharded layers on CPU meshes: the helpers the project's own tests use.

A CPU host pretends to have N devices when XLA is told so before its CPU client starts, i.e.
before the first jax operation. Then a mesh of any shape (data 2 × expert 2 × tensor 2, …) runs on
the CPU, and a sharded program can be compared with its single-device run. The pieces:

* `force_cpu_devices(n)` / the pytest plugin (`-p dsv41_jax.testing`, or `pytest_plugins =
  ["dsv41_jax.testing"]` in a conftest.py) ask for N fake CPU devices; `cpu_devices(n)` and
  `cpu_mesh({"data": 2, ...})` get them or fail naming the environment variables to set.
* `tiny_config(**overrides)`: a micro `ModelConfig` (8 layers) whose layer plan holds every CSA2
  mode (SWA, Full, Reuse, Reindex), Engram layers and the encoder/decoder split (CED);
  `tiny_vision_config` a one-layer ViT for it.
* `packed_batch(cfg, seed)`: a random packed batch as training sees it (several documents per
  row, padding, optional image spans, Engram hash ids from `dsv41_jax.inputs.engram_ids`);
  `make_batch` derives the same keys from given tokens and segments.
* `assert_sharded_matches(fn, args, mesh)`: runs `fn` on the mesh and on one device, compares
  outputs and gradients, optionally against a float64 run (tolerance rule in its docstring).
* `count_collectives(compiled)`: all-reduce, all-gather, reduce-scatter, all-to-all and
  collective-permute in a compiled program's HLO, so a sharding regression fails loudly;
  `single_device_groups(line)`: whether a collective's replica groups are one device each.

Worked example: docs/testing.md. Batches follow the packed-row layout of docs/design.md §14;
meshes and logical-axis rules are `dsv41_jax.sharding`'s (docs/design.md §T1).
"""

from __future__ import annotations

import collections
import math
import os
import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsv41_jax import inputs, sharding
from dsv41_jax.config import ModelConfig

DEFAULT_CPU_DEVICES = 8

# --- devices and meshes -------------------------------------------------------------------------

_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA's depth-first CPU schedule: with the breadth-first default, collectives inside and outside a
# conditional could run in different orders on different fake devices and stop the program
# (docs/user_guide.md §8, launch/xla_flags.py). A setting already in XLA_FLAGS wins.
_SCHEDULE_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def _env_recipe(n: int) -> str:
  return (f"set XLA_FLAGS={_COUNT_FLAG}={n} and JAX_PLATFORMS=cpu in the environment before jax "
          f"is imported, e.g. `XLA_FLAGS={_COUNT_FLAG}={n} JAX_PLATFORMS=cpu python -m pytest`, "
          f"or in the first lines of conftest.py: `os.environ['XLA_FLAGS'] = "
          f"'{_COUNT_FLAG}={n}'; os.environ['JAX_PLATFORMS'] = 'cpu'` (or load the plugin: "
          f"`pytest_plugins = ['dsv41_jax.testing']`)")


def _backends_started() -> bool:
  from jax._src import xla_bridge  # no public query exists; this one is stable since jax 0.4
  return xla_bridge.backends_are_initialized()


def force_cpu_devices(n: int = DEFAULT_CPU_DEVICES) -> None:
  """Make jax start with `n` CPU devices and the CPU platform only.

  Works until the first jax operation (importing jax is fine). Sets XLA_FLAGS (keeping any other
  flags, replacing an earlier device count, adding XLA's depth-first CPU schedule unless the flag
  is set) and JAX_PLATFORMS=cpu. Raises RuntimeError when jax has already started with fewer
  than `n` devices.
  """
  if n < 1:
    raise ValueError(f"asked for {n} CPU devices; need at least 1")
  if _backends_started():
    have = len(jax.devices("cpu"))
    if have < n:
      raise RuntimeError(f"jax already started with {have} CPU devices, fewer than the {n} asked "
                         f"for; {_env_recipe(n)}")
    return
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT_FLAG)]
  if not any(f.startswith(_SCHEDULE_FLAG) for f in flags):
    flags.append(f"{_SCHEDULE_FLAG}=false")
  os.environ["XLA_FLAGS"] = " ".join([*flags, f"{_COUNT_FLAG}={n}"])
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")


def pytest_configure(config) -> None:
  """Pytest plugin hook (`-p dsv41_jax.testing`): every test process sees 8 CPU devices.

  An explicit XLA_FLAGS device count in the environment wins, so `XLA_FLAGS=...=4 pytest` still
  tests a 4-device host.
  """
  del config
  if _COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    force_cpu_devices(DEFAULT_CPU_DEVICES)
  elif "JAX_PLATFORMS" not in os.environ and not _backends_started():
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")   # jax read the environment when it was imported


def cpu_devices(n: int) -> list[jax.Device]:
  """The first `n` CPU devices, or a ValueError naming the environment variables to set."""
  try:
    have = jax.devices("cpu")
  except RuntimeError:   # JAX_PLATFORMS excludes the CPU
    have = []
  if n > len(have):
    raise ValueError(f"asked for {n} CPU devices but jax has {len(have)}: {_env_recipe(n)}")
  return list(have[:n])


def cpu_mesh(shape: Mapping[str, int]) -> Mesh:
  """A mesh over `sharding.MESH_AXES` on fake CPU devices, e.g. {"data": 2, "expert": 2,
  "tensor": 2} (missing axes have size 1), using the first prod(shape) devices."""
  sizes = [int(v) for v in shape.values()]
  if any(s < 1 for s in sizes):
    raise ValueError(f"mesh sizes must be positive (got {dict(shape)})")
  return sharding.make_mesh(shape, cpu_devices(math.prod(sizes)))


# --- a micro model config ---------------------------------------------------------------------

def tiny_config(**overrides) -> ModelConfig:
  """8 layers at 32 tokens, float32: the plan has every CSA2 mode, Engram and CED halves.

  Encoder: SWA + Engram, Full (m = 2) + Engram, Reuse × 2; decoder: Full (m = 1), Reindex × 3 (one
  scanned run with a kind switch). `overrides` are `ModelConfig` fields, e.g.
  `kv_source_input="encoder_final"`, `moe_dispatch="capacity"`, `vision=tiny_vision_config()`.
  """
  base = dict(
      vocab_size=128, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, head_dim=32,
      qk_rope_head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=16, sliding_window=8,
      compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4),
      index_source_layer_ids=(1, 4, 5, 6, 7), index_n_heads=2, index_head_dim=16, index_topk=4,
      yarn_enabled=False, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      engram_layer_ids=(0, 1), engram_n_heads=2, engram_head_dim=8, engram_vocab_size=211,
      engram_compressed_vocab_size=128, seq_len=32, dtype="float32", hc_init_fn_std=0.02,
      # Compile time dominates unit tests; rematerialisation is exercised by the training runs.
      remat=False)
  base.update(overrides)
  return ModelConfig(**base)


def tiny_vision_config(**overrides):
  """A one-layer ViT on an 84-px canvas (2 × 2 cells of 42 px) with a 24-wide projector."""
  from dsv41_jax.vision.config import VisionConfig
  base = dict(num_layers=1, hidden_size=16, num_heads=2, intermediate_size=24, projector_hidden=24,
              max_image_size=84, remat=False)
  base.update(overrides)
  return VisionConfig(**base)


# --- packed batches -----------------------------------------------------------------------------

def inference_micro_config(**overrides) -> ModelConfig:
  """The inference tests' micro model: `tiny_config` with the candidate pool (source at the
  decoder's Full layer 4) and capacity dispatch that drops nothing."""
  base = dict(index_head_dim=32, use_candidate_pool=True, candidate_source_layer_id=4,
              candidate_block_size=2, candidate_topk_blocks=2, moe_dispatch="capacity",
              moe_capacity_factor=2.0)
  return tiny_config(**{**base, **overrides})


def decode_reference(cfg: ModelConfig, T: int):
  """(decoder, tokens [1, T], the forward pass's logits [T, V]) of `cfg`'s model at seed 0, with
  random MoE routing biases and caches holding the forward pass's own values
  (`stored_formats=False`): what every prefill and decode path is compared against."""
  from dsv41_jax import model as M                     # the model imports this module's users
  from dsv41_jax.inference import Decoder
  model = M.init_model(cfg, 0)
  bias = jax.random.normal(jax.random.key(3), (cfg.num_hidden_layers, 2, cfg.n_routed_experts)) * 0.1
  dec = Decoder(model, bias, stored_formats=False)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
  batch = dict(tokens=jnp.asarray(tokens), positions=jnp.arange(T)[None],
               segment_ids=jnp.ones((1, T), jnp.int32),
               engram_ids={k: jnp.asarray(v) for k, v in dec.engram_ids(tokens).items()})
  ref = np.asarray(jax.jit(lambda b: model(b, bias)[0])(batch))[0]
  return dec, tokens, ref


def make_batch(cfg: ModelConfig, tokens_BxT, segment_ids_BxT, image_mask_BxT=None, *,
               pad_id: int = 0, compression_map: np.ndarray | None = None) -> dict[str, Any]:
  """The model's and the loss's batch keys for given tokens and document layout (numpy).

  As `data/packing.py` lays rows out: segment 0 is padding, documents numbered from 1;
  `positions` restart at 0 in each document (0 on padding); `targets` are the next token of the
  same document (`pad_id` elsewhere); `loss_mask` is false on padding, on each document's last
  token and where the token or its target is an image placeholder. `engram_ids` are computed
  exactly as training computes them (`dsv41_jax.inputs.engram_ids`).
  """
  tokens = np.asarray(tokens_BxT, np.int32)
  seg = np.asarray(segment_ids_BxT, np.int32)
  if tokens.ndim != 2 or seg.shape != tokens.shape:
    raise ValueError(f"tokens {tokens.shape} and segment_ids {seg.shape} must both be [B, T]")
  image = (np.zeros(tokens.shape, bool) if image_mask_BxT is None
           else np.asarray(image_mask_BxT, bool))
  B, T = tokens.shape
  new_doc = np.ones((B, T), bool)
  new_doc[:, 1:] = seg[:, 1:] != seg[:, :-1]
  idx = np.broadcast_to(np.arange(T), (B, T))
  starts = np.maximum.accumulate(np.where(new_doc, idx, 0), axis=1)
  positions = np.where(seg > 0, idx - starts, 0).astype(np.int32)
  same_next = np.zeros((B, T), bool)
  same_next[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
  targets = np.full((B, T), pad_id, np.int32)
  targets[:, :-1] = np.where(same_next[:, :-1], tokens[:, 1:], pad_id)
  image_next = np.zeros((B, T), bool)
  image_next[:, :-1] = image[:, 1:]
  batch = dict(tokens=tokens, positions=positions, segment_ids=seg, image_mask=image,
               targets=targets, loss_mask=same_next & ~image & ~image_next)
  if cfg.engram_layer_ids:
    batch["engram_ids"] = inputs.engram_ids(cfg, tokens, seg, image, compression_map)
  return batch


def packed_batch(cfg: ModelConfig, seed: int | np.random.Generator = 0, *, batch_size: int = 2,
                 max_docs: int = 3, boundaries: Sequence[Sequence[int]] | None = None,
                 pad_from: Sequence[int | None] | None = None,
                 image_spans: int | Sequence[int] = 0,
                 pad_id: int = 0, image_token_id: int = 1,
                 compression_map: np.ndarray | None = None) -> dict[str, Any]:
  """A random packed batch of `batch_size` rows × `cfg.seq_len` tokens (numpy; see `make_batch`).

  Layout: `boundaries[b]` lists where row b's documents start after the first (default: random,
  1..`max_docs` documents, row 0 always ≥ 2); `pad_from[b]` where its trailing padding begins
  (None: none; default: random, the last row always padded). `image_spans` places that many
  placeholder spans (`image_token_id`, `image_mask`) inside documents of each row (or of row b:
  `image_spans[b]`); with
  `cfg.vision` set, each span is a random image of (h, w) cells with its pixels (`images`,
  `image_cells`, `image_starts`, `image_count`, as `data/packing.py` emits them), otherwise a run
  of 1–4 placeholder tokens.
  """
  rng = np.random.default_rng(seed)
  B, T = batch_size, cfg.seq_len
  if boundaries is None:
    boundaries = []
    for b in range(B):
      n_docs = int(rng.integers(2 if b == 0 else 1, max(max_docs, 2) + 1))
      boundaries.append(sorted(rng.choice(np.arange(2, T - 6), n_docs - 1, replace=False).tolist()))
  if pad_from is None:
    pad_from = [int(rng.integers(T - T // 4, T)) if b == B - 1 or rng.random() < 0.5 else None
                for b in range(B)]
  if len(boundaries) != B or len(pad_from) != B:
    raise ValueError(f"boundaries ({len(boundaries)}) and pad_from ({len(pad_from)}) need one "
                     f"entry per row ({B})")
  seg = np.ones((B, T), np.int32)
  for b, cuts in enumerate(boundaries):
    for c in cuts:
      seg[b, c:] += 1
    if pad_from[b] is not None:
      seg[b, pad_from[b]:] = 0
  spans = [image_spans] * B if isinstance(image_spans, int) else [int(n) for n in image_spans]
  if len(spans) != B or min(spans) < 0:
    raise ValueError(f"image_spans {image_spans} must be a count ≥ 0 or one per row ({B})")
  text = rng.integers(0, cfg.vocab_size - (max(spans) > 0), (B, T))
  if max(spans):   # the placeholder id never occurs in text
    text += text >= image_token_id
  tokens = np.where(seg > 0, text, pad_id).astype(np.int32)
  image = np.zeros((B, T), bool)
  extra = {}
  if max(spans):
    extra = _place_images(cfg, rng, seg, image, spans)
    tokens[image] = image_token_id
  batch = make_batch(cfg, tokens, seg, image, pad_id=pad_id, compression_map=compression_map)
  batch.update(extra)
  return batch


def _place_images(cfg, rng, seg, image, spans_per_row):
  """Marks non-overlapping spans inside documents (`spans_per_row[b]` in row b); returns the
  image keys when `cfg.vision` is set."""
  B, T = seg.shape
  vision = cfg.vision
  M = max(spans_per_row)
  if vision is not None:
    cell = vision.patch_size * vision.unshuffle
    side, limit = vision.max_image_size, vision.max_image_size // cell
    out = dict(images=np.zeros((B, M, side, side, 3), np.uint8),
               image_count=np.asarray(spans_per_row, np.int32),
               image_cells=np.zeros((B, M, 2), np.int32),
               image_starts=np.full((B, M), -1, np.int32))
  for b in range(B):
    for m in range(spans_per_row[b]):
      for _ in range(1000):
        if vision is None:
          h, w = 1, int(rng.integers(1, 5))
        else:
          h, w = (int(v) for v in rng.integers(1, limit + 1, 2))
        n, s = h * w, int(rng.integers(0, T))
        span = slice(s, s + n)
        if (s + n <= T and seg[b, s] > 0 and (seg[b, span] == seg[b, s]).all()
            and not image[b, max(s - 1, 0):s + n + 1].any()):
          break
      else:
        raise ValueError(f"cannot place {spans_per_row[b]} image spans in row {b} of {T} tokens; "
                         "use fewer spans or a longer seq_len")
      image[b, span] = True
      if vision is not None:
        out["images"][b, m, :h * cell, :w * cell] = rng.integers(0, 256, (h * cell, w * cell, 3))
        out["image_cells"][b, m] = (h, w)
        out["image_starts"][b, m] = s
  if vision is None:
    return {}
  order = np.argsort(np.where(out["image_starts"] < 0, T, out["image_starts"]), axis=1)
  for k in ("images", "image_cells", "image_starts"):   # spans in row order, as the packer emits
    out[k] = np.take_along_axis(out[k], order.reshape(order.shape + (1,) * (out[k].ndim - 2)),
                                axis=1)
  return out


# --- running on the mesh and on one device ------------------------------------------------------

def _is_state(x) -> bool:
  return isinstance(x, nnx.State)


def _leaf_paths(tree) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_leaves_with_path(tree)]


def arg_shardings(args: Sequence[Any], mesh: Mesh, in_specs: Sequence[Any] | None = None):
  """Shardings for `args` on `mesh`, one entry of `in_specs` per argument:

  "params" (an `nnx.State`: each parameter by its logical axes, `sharding.state_shardings`),
  "batch" (every array's leading dimension on the batch axes), None (replicated), or a
  PartitionSpec / NamedSharding, or a pytree of them matching the argument. Default: "params"
  for an `nnx.State`, "batch" otherwise. A batch the mesh's batch axes do not divide is a
  ValueError naming the argument.
  """
  if in_specs is None:
    in_specs = ["params" if _is_state(a) else "batch" for a in args]
  if len(in_specs) != len(args):
    raise ValueError(f"in_specs has {len(in_specs)} entries for {len(args)} arguments")
  out = []
  for i, (arg, spec) in enumerate(zip(args, in_specs)):
    if isinstance(spec, str) and spec == "params":
      out.append(sharding.state_shardings(arg, mesh))
    elif isinstance(spec, str) and spec == "batch":
      axes = sharding.batch_axes(mesh)
      n = sharding.batch_ways(mesh)

      def put(path, x, i=i, n=n, axes=axes):
        shape = np.shape(x)
        if shape and shape[0] % n:
          raise ValueError(
              f"argument {i}{jax.tree_util.keystr(path)} has batch (leading) dimension "
              f"{shape[0]}, which the mesh's batch axes {' × '.join(axes)} = {n} do not divide; "
              f"use a batch that is a multiple of {n}, a smaller mesh, or in_specs")
        return sharding.batch_sharding(mesh, len(shape)) if shape else NamedSharding(mesh, P())
      out.append(jax.tree_util.tree_map_with_path(put, arg))
    elif spec is None:
      out.append(jax.tree.map(lambda x: NamedSharding(mesh, P()), arg))
    else:
      to_named = lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, s)
      if isinstance(spec, (P, NamedSharding)):
        out.append(jax.tree.map(lambda x, s=to_named(spec): s, arg))
      else:
        out.append(jax.tree.map(to_named, spec,
                                is_leaf=lambda s: isinstance(s, (P, NamedSharding))))
  return out


def _checked(fn):
  """`fn`, raising a TypeError that names the first output leaf that is not an array."""
  name = getattr(fn, "__name__", repr(fn))

  def checked(*a):
    out = fn(*a)
    for path, leaf in _leaf_paths(out):
      if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
        raise TypeError(f"{name} returned a {type(leaf).__name__} at output{path}; "
                        "assert_sharded_matches compares arrays: return only arrays (or "
                        "pytrees of arrays)")
    return out
  return checked


def _with_vjp(fn, grad_argnums, out_shapes, seed):
  """`fn` → (outputs, gradients of Σ <output, fixed random cotangent> w.r.t. `grad_argnums`)."""
  rng = np.random.default_rng(seed)

  def cot(s):   # float32 values whatever the dtype: the float64 run gets the same cotangents
    if jnp.issubdtype(s.dtype, jnp.inexact):
      return rng.normal(size=s.shape).astype(np.float32).astype(s.dtype)
    return np.zeros(s.shape, jax.dtypes.float0)
  cots = jax.tree.map(cot, out_shapes)

  def run(*args):
    diff = [args[i] for i in grad_argnums]

    def f(*d):
      full = list(args)
      for i, x in zip(grad_argnums, d):
        full[i] = x
      return fn(*full)
    out, vjp = jax.vjp(f, *diff)
    c = jax.tree.map(lambda o, c: jnp.asarray(c, o.dtype) if c.dtype != jax.dtypes.float0 else c,
                     out, cots)
    return out, vjp(c)
  return run


def _one_ulp_away(tree, seed: int):
  """`tree` with each non-zero float32 element moved one ulp up or down at random."""
  rng = np.random.default_rng(seed)

  def move(x):
    x = np.asarray(x)
    if x.dtype != np.float32:
      return x
    toward = np.where(rng.random(x.shape) < 0.5, np.float32(np.inf), np.float32(-np.inf))
    return np.where(x == 0, x, np.nextafter(x, toward)).astype(np.float32)
  return jax.tree.map(move, tree)


def _to64(tree):
  return jax.tree.map(
      lambda x: np.asarray(x, np.float64) if np.asarray(x).dtype == np.float32 else x, tree)


class Comparison(NamedTuple):
  """What `assert_sharded_matches` ran: each run's outputs (`(outputs, grads)` when
  `grad_argnums` is set; jax arrays, the float64 run's as numpy), the arguments as placed on the
  mesh, and the compiled sharded program (for `count_collectives`)."""
  sharded: Any
  single: Any
  float64: Any
  sharded_args: list
  compiled: jax.stages.Compiled
  single_perturbed: Any = None     # the single-device run one ulp away (`float64_perturbed`)


def assert_sharded_matches(fn: Callable, args: Sequence[Any], mesh: Mesh, *,
                           in_specs: Sequence[Any] | None = None,
                           grad_argnums: int | Sequence[int] = (),
                           reference_fn: Callable | None = None,
                           float64: bool | Callable = False,
                           rtol: float | Callable[[str, np.ndarray], float] = 1e-6,
                           atol: float | Callable[[str, np.ndarray], float] = 1e-6,
                           float64_ratio: float = 4.0, float64_floor: float = 1e-5,
                           float64_own_rule: Sequence[str] = (),
                           float64_perturbed: bool = False,
                           cotangent_seed: int = 0) -> Comparison:
  """Run `fn(*args)` jitted on `mesh` and on one device; assert every output leaf agrees.

  Arguments are placed by `arg_shardings(args, mesh, in_specs)` (parameters by their logical
  axes, batches on the batch axes). With `grad_argnums`, the gradients of Σ <output, c> (fixed
  random cotangents c, seeded by `cotangent_seed`) w.r.t. those arguments are compared too.
  `reference_fn` replaces `fn` for the single-device run (e.g. a per-shard restatement).

  Tolerance. Without `float64`: |sharded − single| ≤ atol + rtol·|single| per element
  (`rtol`/`atol` may be functions of the leaf's path and single-device value). With `float64`
  (True: `fn` on float64 copies of the float32 inputs under x64; or a function to call instead,
  e.g. the same program built from a float64 config), the project's rule: sharding only reorders
  float32 arithmetic, so per leaf the sharded run must be as close to the float64 run as the
  single-device float32 run is,

      max|sharded − ref| ≤ float64_ratio · max|single − ref| + float64_floor · max|ref|

  (defaults 4 and 1e-5, ~100 float32 ulps of the leaf's scale, for float64 programs that keep
  some float32 steps, as the model's residual streams and routing do). A wrong collective or a
  missing partial sum is off by O(|leaf|) and fails either rule. `float64_own_rule` names output
  paths (as in the messages, e.g. "[1][0]['embed'].value") that the caller checks against a
  bound derived from that leaf's own arithmetic, from the returned `Comparison`, instead of this
  rule: a leaf that sums many contributions (an embedding table's gradient) whose errors the
  generic 4× rule cannot see.

  `float64_perturbed` takes a second sample of the single-device error: the single-device program
  runs again with every non-zero float32 argument element moved one ulp up or down (at random,
  seeded by `cotangent_seed`), and the rule's max|single − ref| is the larger of the two runs'.
  A float32 run is the exact function at a point about an ulp away (backward error), so both are
  honest samples of the float32 noise at this point; one sample alone can be lucky where the
  program amplifies rounding (a derivative that is large near some input: the Engram gate's
  signed square root near 0, tests/dsv41_jax/test_model.py). Zeros stay zeros.

  Raises ValueError / TypeError naming the problem for a batch the mesh does not divide and for
  outputs that are not arrays. Returns a `Comparison` for further checks.
  """
  if float64_perturbed and float64 is False:
    raise ValueError("float64_perturbed samples the single-device error against the float64 "
                     "run: pass float64 too")
  args = list(args)
  argnums = (grad_argnums,) if isinstance(grad_argnums, int) else tuple(grad_argnums)
  fn = _checked(fn)
  reference_fn = fn if reference_fn is None else _checked(reference_fn)
  if argnums:   # fixed cotangents need the output shapes: one extra trace
    shapes = jax.eval_shape(fn, *args)
    run, ref_run = (_with_vjp(f, argnums, shapes, cotangent_seed) for f in (fn, reference_fn))
  else:
    run, ref_run = fn, reference_fn

  shardings = arg_shardings(args, mesh, in_specs)
  with jax.set_mesh(mesh):
    sargs = jax.device_put(args, shardings)
    compiled = jax.jit(run).lower(*sargs).compile()
    sharded = compiled(*sargs)
  one = jax.device_put(args, jax.devices()[0])   # committed to one device: no mesh anywhere
  single_fn = jax.jit(ref_run)
  single = single_fn(*one)
  perturbed = None
  if float64_perturbed:
    perturbed = single_fn(*jax.device_put(_one_ulp_away(args, cotangent_seed),
                                          jax.devices()[0]))

  paths = [p for p, _ in _leaf_paths(single)]
  s_leaves, o_leaves = jax.tree.leaves(sharded), jax.tree.leaves(single)
  if len(s_leaves) != len(o_leaves):
    raise ValueError(f"the sharded run returned {len(s_leaves)} leaves, the single-device run "
                     f"{len(o_leaves)}")
  ref = None
  if float64 is not False:
    f64 = fn if float64 is True else float64
    with jax.enable_x64(True):
      run64 = _with_vjp(f64, argnums, jax.eval_shape(f64, *_to64(args)), cotangent_seed) \
          if argnums else f64
      ref = jax.tree.map(np.asarray, jax.jit(run64)(*_to64(args)))
    unknown = set(float64_own_rule) - set(paths)
    if unknown:
      raise ValueError(f"float64_own_rule names {sorted(unknown)}, which are not outputs; the "
                       f"outputs are {paths}")
    p_leaves = (jax.tree.leaves(perturbed) if perturbed is not None
                else [None] * len(o_leaves))
    for path, a, b, r, q in zip(paths, o_leaves, s_leaves, jax.tree.leaves(ref), p_leaves,
                                strict=True):
      if path in float64_own_rule:
        continue
      a, b, r = (np.asarray(x, np.float64) for x in (a, b, r))
      if a.shape != r.shape:
        raise ValueError(f"output{path}: float64 run has shape {r.shape}, float32 {a.shape}")
      err1, err2 = np.abs(a - r).max(initial=0), np.abs(b - r).max(initial=0)
      seen = f"single device {err1:.3g}"
      if q is not None:
        err_q = np.abs(np.asarray(q, np.float64) - r).max(initial=0)
        seen += f" (one ulp away {err_q:.3g})"
        err1 = max(err1, err_q)
      bound = float64_ratio * err1 + float64_floor * max(np.abs(r).max(initial=0), 1e-30)
      assert err2 <= bound, (f"output{path}: sharded run is {err2:.3g} from float64, {seen}; "
                             f"bound {float64_ratio}·{err1:.3g} + {float64_floor}·max|ref| = "
                             f"{bound:.3g}")
  else:
    for path, a, b in zip(paths, o_leaves, s_leaves):
      a, b = np.asarray(a), np.asarray(b)
      rt = rtol(path, a) if callable(rtol) else rtol
      at = atol(path, a) if callable(atol) else atol
      np.testing.assert_allclose(b, a, rtol=rt, atol=at,
                                 err_msg=f"output{path}: sharded vs single device")
  return Comparison(sharded, single, ref, sargs, compiled, perturbed)


# --- collectives ----------------------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE_RE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def hlo_text(compiled) -> str:
  """Optimised HLO text of a `Compiled`, a `Lowered` (compiled here) or a string."""
  if isinstance(compiled, str):
    return compiled
  if isinstance(compiled, jax.stages.Lowered):
    compiled = compiled.compile()
  if not isinstance(compiled, jax.stages.Compiled):
    raise TypeError(f"count_collectives takes a jax.stages.Compiled, Lowered or HLO text (got "
                    f"{type(compiled).__name__}); compile with jax.jit(fn).lower(*args).compile()")
  return compiled.as_text()


def count_collectives(compiled) -> dict[str, int]:
  """Collective instructions in the compiled program, by kind (all five kinds, zeros included).

  Counts instructions in the optimised HLO (an async pair `*-start`/`*-done` counts once), so a
  collective inside a loop body counts once however many times the loop runs.
  """
  counts = collections.Counter(m.group(1) for m in _COLLECTIVE_RE.finditer(hlo_text(compiled)))
  return {k: counts.get(k, 0) for k in COLLECTIVES}


_ALONE_LISTED = re.compile(r"replica_groups=(\{\{\d+\}(,\{\d+\})*\}|\[\d+,1\]<=)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def single_device_groups(hlo_line: str) -> bool:
  """Whether the collective on this HLO line has replica groups of one device each (it moves
  nothing), as jax 0.10 prints them (`{{0},{1},…}`, or iota `[8,1]<=[8]`) or jax 0.11
  (`mesh['data'=2,'tensor'=1] {'tensor'}`: a group spans the named mesh axes)."""
  if _ALONE_LISTED.search(hlo_line):
    return True
  m = _MESH_GROUPS.search(hlo_line)
  if m is None:
    return False
  sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
  return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2))) == 1


def compile_sharded(fn: Callable, args: Sequence[Any], mesh: Mesh,
                    in_specs: Sequence[Any] | None = None) -> jax.stages.Compiled:
  """`fn` jitted and compiled for `args` placed on `mesh` by `arg_shardings` (nothing runs)."""
  shardings = arg_shardings(list(args), mesh, in_specs)
  with jax.set_mesh(mesh):
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                            list(args), shardings)
    return jax.jit(fn).lower(*abstract).compile()


# --- programs ----------------------------------------------------------------------------------

def jaxpr_eqns(jaxpr, name: str, keep: Callable[[Any], bool] = lambda eqn: True) -> list:
  """The equations of primitive `name` that `keep` accepts, in a jaxpr (or closed jaxpr) and in
  every jaxpr nested in an equation's parameters (scans, conds, remat, custom VJPs, jit), in
  program order: what a test counts to tell whether a kernel, sort or product runs once or twice."""
  if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name and keep(eqn):
      found.append(eqn)
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else (v,)):
        if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          found += jaxpr_eqns(sub, name, keep)
  return found
