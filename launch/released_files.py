"""Reading a checkpoint in the released layout: its files, their check against a config, and one
tensor's values (docs/checkpoints.md). Headers only until `decode`, which reads one tensor (and
its scale) through memory maps; `launch.convert import` streams the shards with it.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from launch import released_layout as rl
from launch import safetensors as st
from launch import weight_formats as wf

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class ConvertError(RuntimeError):
  """A conversion that cannot be done; the message says what and where."""


# --- reading a released checkpoint ----------------------------------------------------------------

def read_checkpoint(directory: str) -> tuple[dict, dict[str, st.TensorInfo], list[str]]:
  """(config.json, every tensor's location, the shard files in order); headers only."""
  path = os.path.join(directory, "config.json")
  try:
    with open(path) as f:
      config = json.load(f)
  except FileNotFoundError:
    raise ConvertError(f"{path} does not exist (a released checkpoint has config.json beside its "
                       "shards)") from None
  except ValueError as e:
    raise ConvertError(f"{path} is not JSON ({e})") from None
  index = os.path.join(directory, INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map", {})
    shards = list(dict.fromkeys(weight_map.values()))
  else:
    weight_map = None
    shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
    if not shards:
      raise ConvertError(f"{directory} holds no {INDEX} and no *.safetensors file")
  infos: dict[str, st.TensorInfo] = {}
  for shard in shards:
    file = os.path.join(directory, shard)
    if not os.path.exists(file):
      raise ConvertError(f"shard {shard} named by {index} is missing from {directory}")
    infos.update(st.read_header(file))
  for name, shard in (weight_map or {}).items():
    if name not in infos or os.path.basename(infos[name].path) != shard:
      raise ConvertError(f"{index} places {name} in {shard}, which does not hold it")
  return config, infos, shards


def _expected(tensor: rl.Tensor, info: st.TensorInfo, scale: st.TensorInfo | None,
              block: tuple[int, int]) -> str | None:
  """Why a stored tensor cannot be `tensor` (None when it can)."""
  shape, R = tensor.shape, tensor.shape[0]
  if info.dtype in FLOAT_DTYPES and scale is None:
    return None if info.shape == shape else f"{list(shape)} ({tensor.storage})"
  if tensor.storage in ("fp8", "fp8_rows", "fp4") and info.dtype == "F8_E4M3":
    grid = wf.scale_grid(shape, wf.ROW_BLOCK if tensor.storage == "fp8_rows" else block)
    if info.shape == shape and scale is not None and scale.shape == grid:
      return None
    return f"{list(shape)} with a scale of {list(grid)} (FP8)"
  if tensor.storage == "fp4" and info.dtype in ("I8", "U8"):
    packed, grid = (R, shape[1] // 2), (R, shape[1] // wf.FP4_BLOCK)
    if info.shape == packed and scale is not None and scale.shape == grid:
      return None
    return f"{list(packed)} (FP4, two per byte) with a scale of {list(grid)}"
  return f"{list(shape)} ({tensor.storage}), not dtype {info.dtype}"


def check_checkpoint(tensors: list[rl.Tensor], infos: dict[str, st.TensorInfo],
                     block: tuple[int, int]) -> list[str]:
  """Refuse a checkpoint whose names, shapes or dtypes do not match; return the dropped names."""
  known = set()
  for tensor in tensors:
    info = infos.get(tensor.name)
    if info is None:
      raise ConvertError(f"the checkpoint lacks {tensor.name} (the config expects "
                         f"{list(tensor.shape)}, {tensor.storage})")
    scale = infos.get(tensor.scale_name) if tensor.scale_name else None
    why = _expected(tensor, info, scale, block)
    if why is not None:
      got = f"{list(info.shape)} ({info.dtype})"
      if scale is not None:
        got += f" with a scale of {list(scale.shape)}"
      raise ConvertError(f"{tensor.name}: the checkpoint has {got}, the config expects {why}")
    known.update((tensor.name, tensor.scale_name))
  extra = sorted(n for n in infos if n not in known)
  unknown = [n for n in extra if not n.startswith(rl.DROPPED_PREFIXES)]
  if unknown:
    raise ConvertError(f"the checkpoint holds {len(unknown)} tensors the config has no place for, "
                       f"first {unknown[0]} {list(infos[unknown[0]].shape)}")
  return extra


def decode(tensor: rl.Tensor, infos: dict[str, st.TensorInfo], block,
           rows: tuple[int, int] | None = None) -> np.ndarray:
  """The released tensor's values in float32 (only rows start:stop of them, with `rows`; an
  FP8 row-block tensor's scales are per row, so any rows decode alone)."""
  info = infos[tensor.name]
  pick = (lambda a: a) if rows is None else (lambda a: a[rows[0]:rows[1]])
  values = pick(st.read_tensor(info))
  if info.dtype in FLOAT_DTYPES and tensor.scale_name not in infos:
    return np.asarray(values, np.float32)
  scale = st.read_tensor(infos[tensor.scale_name])
  if info.dtype in ("I8", "U8"):
    return wf.decode_fp4(values, scale, tensor.name)
  if rows is not None and tensor.storage != "fp8_rows":
    raise ValueError(f"{tensor.name}: only per-row scales decode by rows")
  return wf.decode_fp8(values, pick(scale), tensor.name,
                       wf.ROW_BLOCK if tensor.storage == "fp8_rows" else block)
