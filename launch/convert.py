"""Convert between a work directory and the released DeepSeek-V4.1 checkpoint layout.

  python -m launch.convert import --config=configs/flash.py:long --checkpoint=RELEASED --workdir=DIR
  python -m launch.convert export --workdir=DIR --checkpoint=OUT [--step=N]

The released layout (docs/checkpoints.md): safetensors shards with `model.safetensors.index.json`
and `config.json`; FP8 dense weights with 32 × 32 E8M0 block scales, FP4 routed experts, FP8
Engram tables, bf16 / float32 elsewhere (`launch.released_layout`, `launch.weight_formats`).

Import checks everything before it writes: the released config.json against the project config
(`--config`, whose model section a later `launch.train --config=...` must repeat), every tensor's
name, shape and dtype against the config (the first offending tensor is named with both shapes),
every shard's header against its file size. It then streams shard by shard into memory-mapped
arrays of the scanned-run layout and saves them as step 0 of `DIR/checkpoints` with the MoE biases;
`DIR/imported.json` marks that step as imported, so `launch.train` starts from it with a fresh
optimizer state (and says so) and `launch.generate` / `launch.score` read it. A ViT in the config
is initialised fresh: the release's vision tower is not imported. Export reads the checkpoint one
stored chunk at a time (TensorStore, `LeafReader`; an import stores a parameter of up to 64 MB as
one chunk and a larger one by layer and expert, then by blocks of rows, `save_weights`), quantizes
with the project's own rules and writes the shards it planned from the shapes. Engram tables go by
blocks of `ROW_BLOCK` rows both ways (export: whole stored chunks at a time). Speed and memory:
docs/checkpoints.md §Speed and memory, `benchmarks/convert_speed.py`. Either direction writes
into a temporary sibling of the destination and renames it at the end: a failure leaves nothing
behind, and an existing destination is replaced only with `--overwrite`. Bad input stops with one
line `error: ...`, exit status 2.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import sys
import time
from typing import Any, Iterator

import jax
import ml_collections
import numpy as np

from configs.common import SectionError, model_config
from dsv41_jax.errors import ConfigError
from dsv41_jax.param_paths import iter_params, path_str
from launch import checkpoint as ckpt_lib
from launch import released_config as rc
from launch import released_layout as rl
from launch import safetensors as st
from launch import weight_formats as wf
from launch.released_files import (INDEX, ConvertError, check_checkpoint, decode,  # noqa: F401
                                   read_checkpoint)

log = logging.getLogger("dsv41.convert")

STORED = {"bf16": "BF16", "f32": "F32"}
ROW_BLOCK = 2**18               # Engram table rows converted at a time (256 MB at D_e = 256)
SAVE_CHUNK_BYTES = 64 * 2**20   # stored chunks of an import: what an export later reads at a time


# --- the destination ------------------------------------------------------------------------------

class Destination:
  """A directory written under a temporary sibling name and renamed into place on success; on
  failure the temporary directory is removed and an existing destination is untouched."""

  def __init__(self, path: str, overwrite: bool):
    self.path = os.path.abspath(path)
    if os.path.exists(self.path) and not overwrite:
      raise ConvertError(f"{self.path} exists; pass --overwrite to replace it")
    self.tmp = f"{self.path}.convert-tmp-{os.getpid()}"

  def __enter__(self) -> str:
    shutil.rmtree(self.tmp, ignore_errors=True)
    try:
      os.makedirs(self.tmp)
    except OSError as e:
      raise ConvertError(f"cannot create {self.tmp}: {e.strerror or e}") from None
    return self.tmp

  def __exit__(self, kind, error, tb) -> bool:
    if kind is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      return False
    old = f"{self.path}.convert-old-{os.getpid()}"
    if os.path.exists(self.path):
      os.rename(self.path, old)
    os.rename(self.tmp, self.path)
    shutil.rmtree(old, ignore_errors=True)
    return False


def _progress(total: int, what: str):
  from tqdm import tqdm
  return tqdm(total=total, unit="tensor", desc=what, file=sys.stderr, dynamic_ncols=True,
              disable=not sys.stderr.isatty())


def _abstract_leaves(mcfg) -> tuple[Any, dict[str, tuple]]:
  """The pure abstract state of the model and its leaf shapes (plus the MoE biases)."""
  from flax import nnx
  from dsv41_jax.model import abstract_model
  _, state = nnx.split(abstract_model(mcfg))
  pure = nnx.as_pure(state)
  leaves = dict(iter_params(pure))
  leaves[rl.MOE_BIAS] = (mcfg.num_hidden_layers, 2, mcfg.n_routed_experts)
  return pure, leaves


def _model(cfg: ml_collections.ConfigDict):
  try:
    mcfg = model_config(cfg)
  except (ConfigError, SectionError, KeyError, TypeError, ValueError) as e:
    raise ConvertError(f"config.model: {e}") from None
  problems = rc.unexportable(mcfg)
  if problems:
    raise ConvertError("the released layout cannot hold this model: " + "; ".join(problems))
  return mcfg


# --- import ---------------------------------------------------------------------------------------

def import_checkpoint(cfg: ml_collections.ConfigDict, checkpoint: str, workdir: str,
                      overwrite: bool = False) -> dict[str, Any]:
  """Released checkpoint → work directory at step 0 (module docstring); returns a summary."""
  released, infos, shards = read_checkpoint(checkpoint)
  try:
    fields = rc.model_fields(released)
  except rc.ConfigMismatch as e:
    raise ConvertError(str(e)) from None
  differ = rc.disagreements(fields, dict(cfg.model))
  if differ:
    raise ConvertError(f"{checkpoint}/config.json and --config disagree: {'; '.join(differ[:6])} "
                       "(use the matching config file or --config.model.<field>=<value>)")
  mcfg = _model(cfg)
  try:
    rc.check_rows(released, mcfg)
  except rc.ConfigMismatch as e:
    raise ConvertError(str(e)) from None
  block = tuple((released.get("quantization_config") or {}).get("weight_block_size", (128, 128)))
  tensors = rl.released_tensors(mcfg)
  dropped = check_checkpoint(tensors, infos, block)
  pure, leaves = _abstract_leaves(mcfg)
  problems = rl.check_coverage(mcfg, leaves, tensors)
  if problems:  # the map itself is wrong for this config: a bug, not bad input
    raise ConvertError(f"the tensor map does not cover this model: {problems[0]}")
  dest = Destination(workdir, overwrite)
  t0 = time.time()
  with dest as tmp:
    scratch = os.path.join(tmp, "scratch")
    os.makedirs(scratch)
    dtypes = {path_str(p): x.dtype for p, x in jax.tree_util.tree_flatten_with_path(pure)[0]}
    dtypes[rl.MOE_BIAS] = np.dtype(np.float32)
    arrays = {path: np.memmap(os.path.join(scratch, f"{n}.bin"), dtype=dtypes[path], mode="w+",
                              shape=shape)
              for n, (path, shape) in enumerate(leaves.items())}
    by_shard = collections.defaultdict(list)
    for tensor in tensors:
      by_shard[infos[tensor.name].path].append(tensor)
    with _progress(len(tensors), "import") as bar:
      for n, shard in enumerate(shards, 1):
        for tensor in by_shard[os.path.join(checkpoint, shard)]:
          pl = tensor.placement
          target = arrays[pl.path]
          if pl.transform == "rows":   # an Engram table, in blocks of rows (docs/checkpoints.md)
            for r0 in range(0, tensor.shape[0], ROW_BLOCK):   # padding rows stay zero
              r1 = min(r0 + ROW_BLOCK, tensor.shape[0])
              target[r0:r1] = decode(tensor, infos, block, (r0, r1))
          else:
            target[pl.index] = rl.from_released(decode(tensor, infos, block), pl.transform,
                                                target[pl.index].shape)
          bar.update(1)
        log.info("shard %d/%d read: %s", n, len(shards), shard)
    vision = _fresh_vision(mcfg, int(cfg.train.seed), arrays)
    save_weights(tmp, 0, jax.tree_util.tree_map_with_path(lambda p, _: arrays[path_str(p)], pure),
                 arrays[rl.MOE_BIAS], leading_axes(tensors))
    del arrays
    shutil.rmtree(scratch)
    out = cfg.to_dict()
    tokenizer = os.path.join(os.path.abspath(checkpoint), "tokenizer.json")
    if not out["data"].get("tokenizer_path") and os.path.exists(tokenizer):
      out["data"]["tokenizer_path"] = tokenizer   # generate/score read the release's tokenizer
    ckpt_lib.write_config(tmp, out)
    summary = {"source": os.path.abspath(checkpoint), "step": 0, "tensors": len(tensors),
               "dropped": len(dropped), "dropped_prefixes": sorted(
                   {n.split(".")[0] for n in dropped}), "fresh": vision,
               "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(tmp, ckpt_lib.IMPORTED), "w") as f:
      json.dump(summary, f, indent=1)
  log.info("imported %d tensors into %s (step 0; %d released tensors dropped: %s; fresh: %s)",
           len(tensors), dest.path, len(dropped), ", ".join(summary["dropped_prefixes"]) or "none",
           ", ".join(vision) or "none")
  return summary


def save_weights(workdir: str, step: int, params, moe_bias,
                 leading: dict[str, int] | None = None) -> None:
  """Step `step` of `workdir/checkpoints` holding only parameters (the model's pure state, leaves
  of numpy arrays or memory maps) and MoE biases: what `launch.generate.load_model` and
  `Checkpointer.restore_imported` read. The arrays are written in place (orbax's default handler
  deep-copies host arrays first, which would hold the whole model in memory), so memory maps are
  paged through, not loaded.

  Stored chunks (what an export reads at a time, `LeafReader`): a leaf of at most
  `SAVE_CHUNK_BYTES` is one chunk; a larger one is split first along its `leading[path]` leading
  axes (the layer and expert indices a released tensor takes, `Placement.index`), one index per
  chunk, then by orbax's rule (the largest axis first) down to `SAVE_CHUNK_BYTES`: an Engram
  table goes by blocks of rows. (Splitting every stacked axis unconditionally made one chunk per
  table row, ~10^6 chunks of 256 bytes at s1, and an export of ~1 MB/s.)"""
  ocp = ckpt_lib.ocp
  registry = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
      (jax.Array, ocp.type_handlers.ArrayHandler()))
  manager = ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"), options=ocp.CheckpointManagerOptions(create=True),
      item_names=("state",),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry)})
  tree = {"params": params, "moe_bias": moe_bias}
  leading = leading or {}

  def chunks(p, x):
    path = path_str(p[1:]) if p[0].key == "params" else rl.MOE_BIAS
    big = np.ndim(x) and np.size(x) * np.dtype(x.dtype).itemsize > SAVE_CHUNK_BYTES
    return ocp.SaveArgs(chunk_byte_size=SAVE_CHUNK_BYTES,
                        shard_axes=tuple(range(leading.get(path, 0))) if big else ())

  save_args = jax.tree_util.tree_map_with_path(chunks, tree)
  manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree, save_args=save_args)))
  manager.wait_until_finished()
  manager.close()


def _fresh_vision(mcfg, seed: int, arrays: dict[str, np.ndarray]) -> list[str]:
  """Fill the vision pathway's leaves with a fresh initialisation (the release's vision tower is
  not imported); returns the prefixes filled."""
  if mcfg.vision is None:
    return []
  import jax.numpy as jnp
  from flax import nnx
  from dsv41_jax.vision.projector import Projector
  from dsv41_jax.vision.vit import ViT
  rngs, pd = nnx.Rngs(seed), jnp.dtype(mcfg.param_dtype)
  parts = {"vision": ViT(mcfg.vision, rngs, dtype=mcfg.dtype, param_dtype=pd),
           "projector": Projector(mcfg.vision, mcfg.hidden_size, rngs, dtype=mcfg.dtype,
                                  param_dtype=pd)}
  for prefix, module in parts.items():
    for p, x in jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(module)))[0]:
      arrays[f"{prefix}/{path_str(p)}"][...] = np.asarray(x)
  log.warning("the release's vision tower is not imported: the ViT and projector start fresh "
              "(seed %d)", seed)
  return list(parts)


# --- export ---------------------------------------------------------------------------------------

def _stored(tensor: rl.Tensor) -> list[tuple[str, str, tuple[int, ...]]]:
  """(name, dtype, shape) of the file entries of one released tensor."""
  R, C = tensor.shape[0], tensor.shape[-1]
  if tensor.storage in STORED:
    return [(tensor.name, STORED[tensor.storage], tensor.shape)]
  if tensor.storage == "fp4":
    return [(tensor.name, "I8", (R, C // 2)), (tensor.scale_name, "F8_E8M0", (R, C // wf.FP4_BLOCK))]
  block = wf.ROW_BLOCK if tensor.storage == "fp8_rows" else wf.FP8_TILE
  return [(tensor.name, "F8_E4M3", tensor.shape),
          (tensor.scale_name, "F8_E8M0", wf.scale_grid(tensor.shape, block))]


def encode(tensor: rl.Tensor, x: np.ndarray) -> list[np.ndarray]:
  """The file entries of a released tensor from its float values (in `_stored` order)."""
  import ml_dtypes
  if tensor.storage == "bf16":
    return [np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)]
  if tensor.storage == "f32":
    return [np.asarray(x, np.float32)]
  if tensor.storage == "fp4":
    return list(wf.encode_fp4(x, tensor.name))
  return list(wf.encode_fp8(x, wf.ROW_BLOCK if tensor.storage == "fp8_rows" else wf.FP8_TILE))


class LeafReader:
  """A checkpoint's parameters read through TensorStore (array specs from orbax,
  `ocp.type_handlers.get_json_tspec_read`, names from the checkpoint's `_METADATA`), one slab at a
  time: the rows of a parameter's leading axes that one stored chunk spans, with all of its other
  axes. A chunk is decoded whole, so a slab is the smallest read; `export_checkpoint` visits each
  once and keeps only the current one."""

  def __init__(self, state_dir: str):
    import ast
    import orbax.checkpoint as ocp
    from etils import epath
    path = os.path.join(state_dir, "_METADATA")
    try:
      with open(path) as f:
        meta = json.load(f)
    except (OSError, ValueError) as e:
      raise ConvertError(f"cannot read {path} ({e}); not an orbax checkpoint") from None
    self.ocp, self.dir, self.meta = ocp, epath.Path(state_dir), meta
    self.context = ocp.type_handlers.get_ts_context()
    self.names = {}
    for key in meta.get("tree_metadata", {}):
      keys = ast.literal_eval(key)
      if keys[0] == "params":
        self.names["/".join(str(k) for k in keys[1:])] = ".".join(str(k) for k in keys)
      elif keys == (rl.MOE_BIAS,):
        self.names[rl.MOE_BIAS] = rl.MOE_BIAS
    self.arrays: dict[str, Any] = {}
    self.chunks: dict[str, tuple[int, ...]] = {}
    self.slab: tuple = (None, None, None)   # (path, slab key, array)

  def array(self, path: str):
    import tensorstore as ts
    if path not in self.arrays:
      if path not in self.names:
        raise ConvertError(f"the checkpoint in {self.dir} has no parameter {path}")
      info = self.ocp.type_handlers.ParamInfo(name=self.names[path], parent_dir=self.dir,
                                              use_zarr3=self.meta.get("use_zarr3", False),
                                              ts_context=self.context)
      spec = self.ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.meta.get(
          "use_ocdbt", True))
      self.arrays[path] = ts.open(spec, context=self.context).result()
    return self.arrays[path]

  def chunk(self, path: str) -> tuple[int, ...]:
    """The stored chunk shape of a parameter (what TensorStore decodes at a time)."""
    if path not in self.chunks:
      self.chunks[path] = tuple(self.array(path).chunk_layout.read_chunk.shape)
    return self.chunks[path]

  def slab_key(self, path: str, index: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i // c for i, c in zip(index, self.chunk(path)))

  def row_step(self, path: str) -> int:
    """Rows of an Engram table read at a time: whole stored chunks, `ROW_BLOCK` or one chunk."""
    c = self.chunk(path)[0]
    return c if c >= ROW_BLOCK else ROW_BLOCK // c * c

  def rows(self, path: str, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of a parameter (an Engram table, read in blocks)."""
    return np.asarray(self.array(path)[start:stop].read().result())

  def read(self, path: str, index: tuple[int, ...]) -> np.ndarray:
    """The slice `index` (leading indices) of parameter `path`, from its slab."""
    key, chunk = self.slab_key(path, index), self.chunk(path)
    if self.slab[:2] != (path, key):
      rows = tuple(slice(k * c, (k + 1) * c) for k, c in zip(key, chunk))
      self.slab = (None, None, None)            # free the previous slab before reading
      self.slab = (path, key, np.asarray(self.array(path)[rows].read().result()))
    return self.slab[2][tuple(i - k * c for i, k, c in zip(index, key, chunk))]


def leading_axes(tensors: list[rl.Tensor]) -> dict[str, int]:
  """{leaf path: the number of leading axes released tensors index it by} (`save_weights`)."""
  return {t.placement.path: len(t.placement.index) for t in tensors}


def export_checkpoint(workdir: str, checkpoint: str, step: int | None = None,
                      overwrite: bool = False, shard_bytes: float = 5e9) -> dict[str, Any]:
  """Work directory (step `step`, default the newest) → released checkpoint; returns a summary."""
  from launch.generate import checkpoint_steps
  path = os.path.join(workdir, "config.json")
  try:
    with open(path) as f:
      cfg = ml_collections.ConfigDict(json.load(f))
  except (OSError, ValueError) as e:
    raise ConvertError(f"cannot read {path} ({e}); --workdir must be a launch.train or "
                       "launch.convert work directory") from None
  steps = checkpoint_steps(workdir)
  if not steps:
    raise ConvertError(f"{workdir} holds no checkpoint")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise ConvertError(f"{workdir} has no checkpoint of step {step} (steps {steps})")
  mcfg = _model(cfg)
  tensors = rl.released_tensors(mcfg)
  narrow = next((t for t in tensors if t.storage == "fp4" and t.shape[1] % wf.FP4_BLOCK), None)
  if narrow is not None:
    raise ConvertError(f"{narrow.name} {list(narrow.shape)}: the released FP4 experts need input "
                       f"widths (hidden_size, moe_intermediate_size) that are multiples of "
                       f"{wf.FP4_BLOCK}")
  _, leaves = _abstract_leaves(mcfg)
  reader = LeafReader(os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state"))
  by_leaf: dict[str, list[rl.Tensor]] = {}
  for t in tensors:
    by_leaf.setdefault(t.placement.path, []).append(t)
  tensors = [t for path, ts_ in by_leaf.items() for t in sorted(
      ts_, key=lambda t: reader.slab_key(path, t.placement.index))]   # each slab read once
  files: list[list] = [[]]      # the shards planned from the shapes; a weight and its scale together
  used = 0
  for t in tensors:
    size = sum(int(np.prod(s)) * st.DTYPES[d].itemsize for _, d, s in _stored(t))
    if files[-1] and used + size > shard_bytes:
      files.append([])
      used = 0
    files[-1] += _stored(t)
    used += size
  names = [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
  dest = Destination(checkpoint, overwrite)
  t0 = time.time()
  with dest as tmp:
    entries = iter(_stored(t) for t in tensors)
    with _progress(len(tensors), "export") as bar:
      position = 0
      for shard, plan in zip(names, files):
        writer = st.ShardWriter(os.path.join(tmp, shard), plan, {"format": "pt"})
        while not writer.complete():
          t = tensors[position]
          pl = t.placement
          stored = next(entries)
          if pl.transform == "rows":   # an Engram table: whole chunks, encoded by ROW_BLOCK rows
            rows = reader.row_step(pl.path)
            for r0 in range(0, t.shape[0], rows):
              x = reader.rows(pl.path, r0, min(r0 + rows, t.shape[0]))
              for b0 in range(0, len(x), ROW_BLOCK):
                for (name, _, _), array in zip(stored, encode(t, x[b0:b0 + ROW_BLOCK])):
                  writer.write_rows(name, r0 + b0, array)
              del x
          else:
            x = rl.to_released(reader.read(pl.path, pl.index), pl.transform, t.shape)
            for (name, _, _), array in zip(stored, encode(t, x)):
              writer.write(name, array)
          position += 1
          bar.update(1)
        writer.close()
        log.info("shard %s written (%d tensors)", shard, len(plan))
    weight_map = {name: names[k] for k, plan in enumerate(files) for name, _, _ in plan}
    total = sum(int(np.prod(s)) * st.DTYPES[d].itemsize for plan in files for _, d, s in plan)
    with open(os.path.join(tmp, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(rc.config_json(mcfg), f, indent=1)
    tokenizer = cfg.data.get("tokenizer_path", "")
    if tokenizer and tokenizer.endswith(".json") and os.path.exists(tokenizer):
      shutil.copy(tokenizer, os.path.join(tmp, "tokenizer.json"))
  dropped = sorted({p.split("/")[0] for p in leaves if p.startswith(rl.UNRELEASED_PREFIXES)})
  log.info("exported step %d of %s: %d tensors in %d shards to %s (not exported: optimizer "
           "state%s)", step, workdir, len(tensors), len(files), dest.path,
           "".join(f", {d}" for d in dropped))
  return {"step": step, "tensors": len(tensors), "shards": len(files), "bytes": total,
          "dropped": dropped, "seconds": round(time.time() - t0, 1)}


# --- command line ---------------------------------------------------------------------------------

def define_flags():
  """The command line's flags (defined only when run as a program, so the module imports cleanly)."""
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "import: the project config the checkpoint "
                                  "must match (the same --config launch.train is given).",
                                  lock_config=True)
  flags.DEFINE_string("checkpoint", None, "The released-layout directory: import source, export "
                      "destination.")
  flags.DEFINE_string("workdir", None, "The work directory: import destination, export source.")
  flags.DEFINE_integer("step", None, "export: the checkpoint step (default: the newest).")
  flags.DEFINE_bool("overwrite", False, "Replace an existing destination.")
  flags.DEFINE_float("shard_gb", 5.0, "export: bytes per safetensors shard, in GB.")


def main(argv):
  from absl import flags
  from launch import cli
  cli.log_to_stderr()
  f = flags.FLAGS
  try:
    if len(argv) != 2 or argv[1] not in ("import", "export"):
      raise ConvertError("give one command: import or export (python -m launch.convert import "
                         "--config=... --checkpoint=... --workdir=...)")
    for name in ("checkpoint", "workdir") + (("config",) if argv[1] == "import" else ()):
      if not getattr(f, name):
        raise ConvertError(f"{argv[1]} needs --{name}")
    if argv[1] == "import":
      summary = import_checkpoint(f.config, f.checkpoint, f.workdir, f.overwrite)
    else:
      summary = export_checkpoint(f.workdir, f.checkpoint, f.step, f.overwrite, f.shard_gb * 1e9)
  except (ConvertError, st.FormatError, wf.FormatError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(summary))


if __name__ == "__main__":
  from absl import app
  from launch import cli
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
