"""Training logs: `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files.

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

# Dense bf16 peak from the datasheets, the MFU denominator (TRAINING.md §5).
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


class MetricWriter:
  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self.jsonl = None
    self.tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    flat = flatten(metrics)
    record = {"step": int(step)}
    record.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                   for k, v in flat.items()})
    self.jsonl.write(json.dumps(record) + "\n")
    self.jsonl.flush()
    for k, v in flat.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        self.tb.add_scalar(k, v, step)

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tb.close()
