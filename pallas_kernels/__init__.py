"""Pallas kernels and the one switch through which the model reaches them (TRAINING.md §5).

Each kernel restates the math of a pure function of the model (it never imports `dsv41_jax`) and
has the same signature, so `select(name, kernels, reference)` can hand back either one:

| name                      | kernel                                   | reference (model)                 |
|---------------------------|------------------------------------------|-----------------------------------|
| `fp4_main_kv_fake_quant`  | `pallas_kernels.fp4.fp4_main_kv_fake_quant` | `fake_quant(x, quant.fp4_main_kv)` |
| `hc_coefficients`         | `pallas_kernels.mhc.hc_coefficients`     | `layers.mhc.hc_coefficients`      |

`kernels` is the config switch `ModelConfig.kernels`: "xla" returns the reference, "pallas" the
kernel. Both compute the same function and are differentiable (the kernels carry a custom VJP).
"""

from __future__ import annotations

import importlib
from typing import Callable

# name -> (module, attribute); modules are imported on first use.
_KERNELS: dict[str, tuple[str, str]] = {
    "fp4_main_kv_fake_quant": ("pallas_kernels.fp4", "fp4_main_kv_fake_quant"),
    "hc_coefficients": ("pallas_kernels.mhc", "hc_coefficients"),
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
