"""Newton–Schulz schedules (optim/muon.py NS_SCHEDULES): the Polar Express quintics against a
float64 numpy restatement of the same polynomial iteration, their singular values, and the switch
OptimConfig.ns_schedule."""

import jax.numpy as jnp
import numpy as np
import pytest

from optim import muon
from optim.config import OptimConfig, OptimConfigError

# Amsel et al. 2025 (arXiv 2505.16932), the authors' polar_express/basic.py: the published
# quintics, the first seven divided by 1.01, 1.01³, 1.01⁵; the input divided by 1.01·‖X‖_F.
_PUBLISHED = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
              (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
              (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
              (3.3184196573706015, -2.488488024314874, 0.51004894012372),
              (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
              (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
              (1.8750014808534479, -1.2500016453999487, 0.3750001645474248))
_LAST = (1.875, -1.25, 0.375)
SHAPES = ((48, 24), (24, 40), (3, 16, 32))        # tall, wide, batched


def _coeffs64():
  return [(a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in _PUBLISHED] + [_LAST]


def _iterate64(x: np.ndarray) -> np.ndarray:
  """X ← aX + bXXᵀX + c(XXᵀ)²X per step, in float64 (wide orientation)."""
  tall = x.shape[-2] > x.shape[-1]
  x = np.swapaxes(x, -1, -2) if tall else x
  for a, b, c in _coeffs64():
    g = x @ np.swapaxes(x, -1, -2)
    x = a * x + b * g @ x + c * g @ g @ x
  return np.swapaxes(x, -1, -2) if tall else x


def _batch(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).reshape(-1, *shape[-2:])


def test_polar_express_table_is_the_published_one():
  np.testing.assert_array_equal(np.asarray(muon.PE_COEFFS), np.asarray(_coeffs64()))
  assert muon.schedule("polar_express").margin == 1.01
  assert muon.schedule("spec") == muon.Schedule(muon.NS_COEFFS, 1.0)


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_polar_express_matches_float64_iteration(ns_dtype):
  """Same polynomial steps in float64 on the iterate's own (rounded) input: float32 to 2e-6
  (measured 7e-7); the bfloat16 iterate (each step's X ← PX rounded to 2⁻⁹) to 0.04/√max(m, n),
  the bound the spec schedule's bfloat16 test uses (measured 4.4e-3 at 32)."""
  rng = np.random.default_rng(11)
  dt = jnp.float32 if ns_dtype == "float32" else jnp.bfloat16
  for shape in SHAPES:
    g = _batch(rng, shape)
    x0 = np.asarray(muon._normalized(g, 1.01).astype(dt).astype(jnp.float32), np.float64)
    ref = _iterate64(x0)
    out = np.asarray(muon.newton_schulz(g, ns_dtype, "polar_express"), np.float64)
    tol = 2e-6 if ns_dtype == "float32" else 0.04 / np.sqrt(max(shape[-2:]))
    assert np.abs(out - ref).max() < tol, (shape, np.abs(out - ref).max())


def test_polar_express_lands_singular_values_in_band():
  """The composition was built for σ/σ_max ≥ 1e-3 (l = 1e-3): in float64 it maps [1e-3, 1]/1.01
  onto 1 within 1e-12; on matrices whose spectrum spans [1e-3, 1]·‖X‖_F-relative the float32
  output is within 1 ± 1e-6 and the bfloat16 one within 1 ± 5e-5 (measured 2e-7, 1.4e-5)."""
  s = np.concatenate([np.linspace(1e-3, 1, 100001), np.geomspace(1e-3, 1, 1001)]) / 1.01
  for a, b, c in _coeffs64():
    s = a * s + b * s ** 3 + c * s ** 5
  assert np.abs(s - 1).max() < 1e-12, np.abs(s - 1).max()
  rng = np.random.default_rng(12)
  m, n = 64, 32
  u, _ = np.linalg.qr(rng.standard_normal((m, n)))
  v, _ = np.linalg.qr(rng.standard_normal((n, n)))
  sv = np.logspace(0, -1.5, n)                     # smallest σ / ‖X‖_F ≈ 8e-3
  g = jnp.asarray(np.stack([(u * sv) @ v.T, rng.standard_normal((m, n))]), jnp.float32)
  for ns_dtype, tol in (("float32", 1e-6), ("bfloat16", 5e-5)):
    for o in np.asarray(muon.newton_schulz(g, ns_dtype, "polar_express"), np.float64):
      s = np.linalg.svd(o, compute_uv=False)
      assert np.abs(s - 1).max() < tol, (ns_dtype, s.min(), s.max())


def test_polar_express_on_a_spectral_tail_is_the_composed_polynomial():
  """Singular values down to 3e-5 of the largest, where the composition has not converged (the
  smallest lands at 0.13): the float32 output is U·p(Σ / (1.01‖Σ‖))·Vᵀ with p the composed
  quintics in float64, to 5e-5 (measured 2e-5), tall and wide; this pins the input's 1.01."""
  rng = np.random.default_rng(14)
  for m, n in ((64, 32), (32, 48)):
    k = min(m, n)
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    s = np.geomspace(1, 3e-5, k)
    r = s / (1.01 * np.linalg.norm(s))
    for a, b, c in _coeffs64():
      r = a * r + b * r ** 3 + c * r ** 5
    g = jnp.asarray(((u * s) @ v.T)[None], jnp.float32)
    o = np.asarray(muon.newton_schulz(g, "float32", "polar_express"), np.float64)[0]
    assert np.abs(o - (u * r) @ v.T).max() < 5e-5, np.abs(o - (u * r) @ v.T).max()
    assert np.abs(np.linalg.svd(o, compute_uv=False) - r).max() < 5e-5


def test_schedule_switch_reaches_the_update_and_rejects_unknown_names():
  rng = np.random.default_rng(13)
  g = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
  tx = muon.scale_by_muon(0.0, 0.18, lambda p: False, "float32", ns_schedule="polar_express")
  u, _ = tx.update({"w": g}, tx.init({"w": g}))
  want = muon.muon_direction(g, False, 0.18, "float32", "polar_express")
  np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(want))
  assert not np.array_equal(np.asarray(want), np.asarray(muon.muon_direction(g, False, 0.18)))
  assert OptimConfig().ns_schedule == "spec"
  with pytest.raises(OptimConfigError, match="ns_schedule must be one of 'spec', 'polar_express'"):
    OptimConfig(ns_schedule="polar")
  with pytest.raises(ValueError, match="ns_schedule 'polar' is not one of"):
    muon.orthogonalize(g, False, ns_schedule="polar")
