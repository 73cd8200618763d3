"""Pallas kernels and the one switch through which the model reaches them (docs/design.md §T5).

Each kernel restates the math of a pure function of the model (it never imports `dsv41_jax`) and
has the same signature, so `select(name, kernels, reference)` can hand back either one:

| name                      | kernel                                   | reference (model)                 |
|---------------------------|------------------------------------------|-----------------------------------|
| `fp4_main_kv_fake_quant`  | `pallas_kernels.fake_quant.fp4_main_kv_fake_quant` | `fake_quant(x, quant.fp4_main_kv)` |
| `mxfp4_fake_quant`        | `pallas_kernels.fake_quant.mxfp4_fake_quant` | `fake_quant(x, quant.mxfp4)`   |
| `fp8_swa_fake_quant`      | `pallas_kernels.fake_quant.fp8_swa_fake_quant` | `fake_quant(x, quant.fp8_swa)` |
| `hc_coefficients`         | `pallas_kernels.mhc.hc_coefficients`     | `layers.mhc.hc_coefficients`      |
| `hc_site`                 | `pallas_kernels.mhc_site.hc_site`        | `layers.mhc.hc_site`              |
| `sparse_attend`           | `pallas_kernels.sparse_attention.sparse_attend` | `layers.sparse_attention.attend` |
| `indexer_score_and_select` | `pallas_kernels.indexer.score_and_select` | `layers.indexer.score_and_select` (no pool) |
| `grouped_matmul`          | `pallas_kernels.grouped_matmul.grouped_matmul` (Mosaic GPU) | `jax.lax.ragged_dot` (`layers.moe_dispatch.grouped_matmul`) |

`kernels` is the config switch `ModelConfig.kernels`: "xla" returns the reference, "pallas" the
kernel. Both compute the same function and are differentiable (the kernels carry a custom VJP).
The CSA2 kernels (`sparse_attend`, `indexer_score_and_select`) take arrays rather than the model's
containers; their call sites check `unsupported(name, ...)` and fall back to XLA with `note_fallback`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

# name -> (module, attribute); modules are imported on first use.
_KERNELS: dict[str, tuple[str, str]] = {
    "fp4_main_kv_fake_quant": ("pallas_kernels.fake_quant", "fp4_main_kv_fake_quant"),
    "mxfp4_fake_quant": ("pallas_kernels.fake_quant", "mxfp4_fake_quant"),
    "fp8_swa_fake_quant": ("pallas_kernels.fake_quant", "fp8_swa_fake_quant"),
    "hc_coefficients": ("pallas_kernels.mhc", "hc_coefficients"),
    "hc_site": ("pallas_kernels.mhc_site", "hc_site"),
    "sparse_attend": ("pallas_kernels.sparse_attention", "sparse_attend"),
    "indexer_score_and_select": ("pallas_kernels.indexer", "score_and_select"),
    "grouped_matmul": ("pallas_kernels.grouped_matmul", "grouped_matmul"),
}


def names() -> tuple[str, ...]:
  return tuple(_KERNELS)


def kernel(name: str) -> Callable:
  """The Pallas implementation registered under `name`."""
  if name not in _KERNELS:
    raise KeyError(f"no Pallas kernel named {name!r}; known: {sorted(_KERNELS)}")
  module, attr = _KERNELS[name]
  return getattr(importlib.import_module(module), attr)


def select(name: str, kernels: str, reference: Callable) -> Callable:
  """`reference` when kernels == "xla", the Pallas kernel `name` when kernels == "pallas"."""
  if kernels == "xla":
    return reference
  if kernels == "pallas":
    return kernel(name)
  raise ValueError(f"kernels must be 'xla' or 'pallas' (got {kernels!r})")


def backend_reason() -> str | None:
  """Why no Pallas kernel can run on the default backend (None: Triton on GPU, interpreted on CPU)."""
  import jax
  backend = jax.default_backend()
  if backend in ("gpu", "cpu"):
    return None
  return f"the Pallas kernels are Triton kernels (GPU; interpreted on CPU), not for {backend!r}"


def unsupported(name: str, *args, **kwargs) -> str | None:
  """Why kernel `name` cannot take these arguments (its module's `unsupported_reason`), or None."""
  module, _ = _KERNELS[name]
  return getattr(importlib.import_module(module), "unsupported_reason")(*args, **kwargs)


_NOTED: set = set()


def log_once(key, message: str) -> None:
  """A warning logged once per `key` for the process (fallbacks, padding notices)."""
  if key not in _NOTED:
    _NOTED.add(key)
    logging.getLogger(__name__).warning(message)


def note_fallback(name: str, reason: str) -> None:
  """Log once per (kernel, reason) that a call of `name` runs the XLA path instead."""
  log_once((name, reason), f"Pallas kernel {name} falls back to XLA: {reason}")
