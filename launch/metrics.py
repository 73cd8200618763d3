"""Training logs: `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files,
plus Weights & Biases when `train.wandb_project` is set (and the `wandb` package is installed).

Every figure written here comes from the function named beside it: MFU from
`dsv41_jax.flops.train_flops_per_token` and `peak_flops_per_device`; padding and skipped records
from the data iterator's counters; expert load from the MoE's per-layer loads.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

# Dense bf16 peak from the datasheets, the MFU denominator (docs/design.md §T5).
_PEAKS = {"H100": 989e12, "H200": 989e12, "H800": 989e12}


def peak_flops_per_device(device_kind: str, configured: float) -> float | None:
  """Configured peak if > 0; else the datasheet peak of a known accelerator; else None."""
  if configured > 0:
    return configured
  for name, peak in _PEAKS.items():
    if name in device_kind:
      return peak
  return None


def mfu(flops_per_token: float, tokens_per_second: float, n_devices: int,
        peak_per_device: float | None) -> float | None:
  """Model FLOPs utilisation = flops/token × tokens/s ÷ (devices × peak)."""
  if not peak_per_device:
    return None
  return flops_per_token * tokens_per_second / (n_devices * peak_per_device)


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
  """Scalars as they are; per-layer arrays as `<name>/<layer>` (and `<name>/<layer>/<i>`)."""
  out: dict[str, float] = {}
  for k, v in metrics.items():
    name = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, name + "/"))
      continue
    a = np.asarray(v)
    if a.ndim == 0:
      out[name] = a.item() if a.dtype != bool else bool(a)
    else:
      for idx in np.ndindex(*a.shape):
        out[name + "/" + "/".join(map(str, idx))] = a[idx].item()
  return out


class MetricsError(RuntimeError):
  """A metrics writer that cannot start; the message names the setting."""


def median(values) -> float | None:
  """The median of the values (None for none): e.g. tokens/s over the logged windows."""
  values = [v for v in values if v is not None and math.isfinite(v)]
  return float(np.median(values)) if values else None


def last_logged(workdir: str) -> dict[str, float]:
  """The last logged train loss (`loss`, `step`) and held-out figures (`eval/...`) of a work
  directory's metrics.jsonl, for the summary of a run that had nothing left to train."""
  out: dict[str, float] = {}
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return out
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      if r.get("loss") is not None:
        out.update(loss=r["loss"], step=r["step"])
      if r.get("eval/loss") is not None:
        out.update({k: v for k, v in r.items() if k.startswith("eval/")}, eval_step=r["step"])
  return out


def roll_back(path: str, step: int) -> int:
  """Keep the records of metrics.jsonl at steps <= `step` (and drop a torn last line); returns
  how many records were dropped. The file is replaced atomically."""
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path) as f:
    for line in f:
      try:
        keep = json.loads(line)["step"] <= step
      except (ValueError, KeyError, TypeError):
        keep = False
      if keep:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  if dropped:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, path)
  return dropped


class MetricWriter:
  """Writes each logged step to metrics.jsonl and TensorBoard (and W&B when `wandb_project`)."""

  def __init__(self, workdir: str, enabled: bool, wandb_project: str = "",
               config: dict | None = None, rollback_to: int | None = None):
    """`rollback_to` = the step a run starts from: the records of later steps (a run lost after
    its last checkpoint, whose steps this run does again) leave metrics.jsonl, and TensorBoard
    hides them (`purge_step`), so every step is logged once."""
    self.enabled = enabled
    self.jsonl = None
    self.tb = None
    self.wandb = None
    if enabled:
      if wandb_project:
        try:
          import wandb
        except ImportError:
          raise MetricsError(f"train.wandb_project={wandb_project!r} is set but the wandb package "
                             "is not installed; pip install wandb, or set "
                             "--config.train.wandb_project=''") from None
        # One W&B run per work directory: a resumed run continues its curves.
        self.wandb = wandb.init(project=wandb_project, dir=workdir, config=config,
                                name=os.path.basename(os.path.abspath(workdir)),
                                id=_run_id(workdir), resume="allow")
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      if rollback_to is not None:
        roll_back(path, rollback_to)
      self.jsonl = open(path, "a")
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                              purge_step=None if rollback_to is None else rollback_to + 1)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    flat = flatten(metrics)
    record = {"step": int(step)}
    record.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                   for k, v in flat.items()})
    self.jsonl.write(json.dumps(record) + "\n")
    self.jsonl.flush()
    scalars = {k: v for k, v in flat.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for k, v in scalars.items():
      self.tb.add_scalar(k, v, step)
    if self.wandb is not None:
      self.wandb.log(scalars, step=int(step))

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tb.close()
      if self.wandb is not None:
        self.wandb.finish()


def _run_id(workdir: str) -> str:
  import hashlib
  return hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:16]
