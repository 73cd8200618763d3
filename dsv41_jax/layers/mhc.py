"""mHC sites: parameters, initialisation and the single-pass start (docs/design.md §3.2–3.4).

The math (coefficients `hc_coefficients`, `sinkhorn_project`, `collapse`, `expand` and the whole
single-pass site `hc_site`) is the op module `pallas_kernels.ops.mhc`, whose docstring has the
equations; its names are imported here so the model reads them as `mhc.collapse` etc. Each
sublayer site ("attn", "ffn") owns `fn` [(2+n)n, n·d], `base` [(2+n)n] and `scale` [3].
V4.1's single-pass schedule (§3.3) collapses with the previous site's `pre`, starting from
`initial_pre(n)` = e_0; that wiring lives in the block (`dsv41_jax/block.py`), not here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.config import ModelConfig
from pallas_kernels import dispatch
from pallas_kernels.ops.mhc import (  # noqa: F401  (the op's math, as the model names it)
    collapse, expand, hc_coefficients, hc_mix, hc_site, sinkhorn_project)


def initial_pre(n: int) -> jax.Array:
  """e_0 [n]: the single-pass collapse weights before the first site (§3.3); exact on X⁰."""
  return jnp.zeros((n,), jnp.float32).at[0].set(1.0)


def init_base(n: int, pre_base: float, res_diag: float) -> np.ndarray:
  """base [(2+n)n] per §3.4: pre part = pre_base, post part = 0, residual part = res_diag · I."""
  return np.concatenate([np.full((n,), pre_base), np.zeros((n,)),
                         (res_diag * np.eye(n)).reshape(-1)]).astype(np.float32)


class MHCSite(nnx.Module):
  """One mHC site's parameters (float32, §3.2) and its coefficient computation.

  fn [(2+n)n, n·d] logical axes ("hc_mix", "embed"), init N(0, hc_init_fn_std²);
  base [(2+n)n] ("hc_mix",), init `init_base`; scale [3] ("hc",), init 1.
  `__call__(X_BxTxNxD) -> (pre, post, comb)`: the op `hc_coefficients` under `cfg.ops`;
  `site(X, F, post, comb, pre, norm_weight)`: the whole single-pass site, the op `hc_site`.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    n, d = cfg.hc_mult, cfg.hidden_size
    self.hc_mult = n
    self.iters = cfg.hc_sinkhorn_iters
    self.hc_eps = cfg.hc_eps
    self.norm_eps = cfg.rms_norm_eps
    self.policies = cfg.ops
    self.fn = sharding.param(rngs, ((2 + n) * n, n * d), ("hc_mix", "embed"),
                             sharding.normal(cfg.hc_init_fn_std))
    self.base = sharding.param(rngs, ((2 + n) * n,), ("hc_mix",), sharding.constant(
        init_base(n, cfg.hc_init_pre_base, cfg.hc_init_res_diag)))
    self.scale = sharding.param(rngs, (3,), ("hc",), sharding.constant(1.0))

  def __call__(self, X_BxTxNxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return dispatch.call("hc_coefficients", X_BxTxNxD, self.fn[...], self.base[...],
                         self.scale[...], policy=self.policies.hc_coefficients, iters=self.iters,
                         hc_eps=self.hc_eps, norm_eps=self.norm_eps)

  def site(self, X_BxTxNxD: jax.Array, F_BxTxD: jax.Array, post_BxTxN: jax.Array,
           comb_BxTxNxN: jax.Array, pre_BxTxN: jax.Array, norm_weight: jax.Array
           ) -> tuple[jax.Array, ...]:
    """(X', x, pre', post', comb') of the single-pass site (`ops.mhc.hc_site`): the previous
    site's expand of X with F, this site's coefficients and the collapse + sublayer norm."""
    return dispatch.call("hc_site", X_BxTxNxD, F_BxTxD, post_BxTxN, comb_BxTxNxN, pre_BxTxN,
                         self.fn[...], self.base[...], self.scale[...], norm_weight,
                         policy=self.policies.hc_site, iters=self.iters, hc_eps=self.hc_eps,
                         norm_eps=self.norm_eps)
