"""Auxiliary-loss-free MoE balancing bias update (docs/design.md §8.3, §T2).

The routing bias is not a parameter and never enters the optimizer. After each step, for each
modality row separately (text, image): b ← b + γ · sign(mean(load) − load). A row whose total load
is zero (no tokens of that modality in the step) is left unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def update_moe_bias(bias_Lx2xE: jax.Array, load_Lx2xE: jax.Array, gamma: float) -> jax.Array:
  """New bias; `bias`/`load` are [..., 2, n_experts] (leading axes = layers), load = token counts."""
  if bias_Lx2xE.shape != load_Lx2xE.shape:
    raise ValueError(f"bias shape {bias_Lx2xE.shape} and load shape {load_Lx2xE.shape} differ")
  if bias_Lx2xE.ndim < 2 or bias_Lx2xE.shape[-2] != 2:
    raise ValueError(f"bias must be [..., 2 (text, image), n_experts]; got {bias_Lx2xE.shape}")
  load = load_Lx2xE.astype(jnp.float32)
  mean = jnp.mean(load, axis=-1, keepdims=True)
  step = gamma * jnp.sign(mean - load)
  active = jnp.sum(load, axis=-1, keepdims=True) > 0
  return (bias_Lx2xE + jnp.where(active, step, 0.0)).astype(bias_Lx2xE.dtype)
