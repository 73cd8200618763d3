"""configs/flash.py: plain RoPE in pre-training, YaRN in the long-context phase (docs/design.md §4.5)."""

import math

import numpy as np
import pytest

from configs import flash
from configs.common import model_config
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers.rope import layer_inv_freq


def _np_inv_freq(layer: int, yarn: bool, r: int = 64) -> np.ndarray:
  """docs/design.md §4.5 restated: layers 0–1 θ = 1e4 plain; the rest θ = 160000, with the YaRN blend
  (factor 16, original 65536, β 32 / 1) only in the long-context phase."""
  theta = 1e4 if layer < 2 else 160000.0
  inv = np.array([theta ** (-2.0 * i / r) for i in range(r // 2)], np.float64)
  if layer < 2 or not yarn:
    return inv
  dim = lambda n_rot: r * math.log(65536 / (n_rot * 2 * math.pi)) / (2 * math.log(theta))
  low, high = max(math.floor(dim(32.0)), 0), min(math.ceil(dim(1.0)), r - 1)
  interp = np.clip((np.arange(r // 2) - low) / (high - low), 0.0, 1.0)   # 1: fully interpolated
  return inv * (1 - interp) + inv / 16.0 * interp


@pytest.mark.parametrize("arg, yarn", [(None, False), ("pretrain", False), ("long", True)])
def test_flash_rope_per_phase(arg, yarn):
  cfg = model_config(flash.get_config(arg))
  assert cfg.yarn_enabled is yarn and cfg.qk_rope_head_dim == 64
  for spec in build_layer_plan(cfg).layers:
    got = layer_inv_freq(cfg, spec)
    np.testing.assert_allclose(got, _np_inv_freq(spec.index, yarn), rtol=1e-13, atol=0)


def test_unknown_phase_is_named():
  with pytest.raises(ValueError, match="unknown phase"):
    flash.get_config("longer")
