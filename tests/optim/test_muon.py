"""Muon group (optim/muon.py) against float64 SVD references on random gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim import muon
from optim.chain import build_optimizer
from optim.config import OptimConfig
from optim.table import Row
from tests.optim import refs

TABLE = (Row("q", "muon", headwise=True), Row("w", "muon"), Row("s", "adamw"))
# Spec: Newton–Schulz leaves singular values in [1, 1.0005]; |O − UVᵀ| ≤ ‖O − UVᵀ‖₂ ≤ 5.4e-4.
NS_ATOL = 6e-4


def _cfg(**kw):
  base = dict(lr=0.01, warmup_steps=0, decay_start=1000, decay_end=2000, schedule_unit="steps",
              clip_norm=0.0, weight_decay=0.1)
  base.update(kw)
  return OptimConfig(**base)


def _params(rng):
  return {"q": jnp.asarray(rng.standard_normal((2, 24, 3, 8)), jnp.float32),   # stacked, heads
          "w": jnp.asarray(rng.standard_normal((2, 3, 16, 40)), jnp.float32),  # stacked, experts
          "s": jnp.asarray(rng.standard_normal((16,)), jnp.float32)}


def _grads(rng, params):
  return {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in params.items()}


def test_two_steps_match_nesterov_polar_reference():
  rng = np.random.default_rng(1)
  cfg = _cfg()
  params = _params(rng)
  tx = build_optimizer(cfg, params, TABLE)
  state = tx.init(params)
  g1, g2 = _grads(rng, params), _grads(rng, params)
  _, state = tx.update(g1, state, params)
  u2, _ = tx.update(g2, state, params)
  beta = cfg.muon_momentum
  for name, headwise in (("q", True), ("w", False)):
    m2 = beta * np.asarray(g1[name], np.float64) + np.asarray(g2[name], np.float64)
    d2 = np.asarray(g2[name], np.float64) + beta * m2
    m, n = muon.matrix_dims(params[name].shape, headwise)
    scale = cfg.update_rms * np.sqrt(max(m, n))
    # undo lr and weight decay: u = −lr (scale · O + wd · p)
    o = (-np.asarray(u2[name], np.float64) / cfg.lr - cfg.weight_decay * np.asarray(params[name]))
    ref = refs.muon_direction(d2, headwise, cfg.update_rms)
    np.testing.assert_allclose(o / scale, ref / scale, rtol=0, atol=NS_ATOL)


def test_headwise_singular_values_and_independence():
  rng = np.random.default_rng(2)
  g = rng.standard_normal((2, 24, 3, 8)).astype(np.float32)
  o = np.asarray(muon.orthogonalize(jnp.asarray(g), headwise=True), np.float64)
  for layer in range(2):
    for h in range(3):
      s = np.linalg.svd(o[layer, :, h, :], compute_uv=False)
      assert np.all(np.abs(s - 1) < 1e-3), (layer, h, s)
  # A different gradient for head 1 leaves heads 0 and 2 bit-identical.
  g2 = g.copy()
  g2[:, :, 1, :] = rng.standard_normal((2, 24, 8))
  o2 = np.asarray(muon.orthogonalize(jnp.asarray(g2), headwise=True))
  np.testing.assert_array_equal(o2[:, :, [0, 2], :], np.asarray(o)[:, :, [0, 2], :].astype(np.float32))
  assert not np.allclose(o2[:, :, 1, :], o[:, :, 1, :], atol=1e-2)
  # Vanilla Muon over (in, heads·head_dim) would mix heads: the head-wise result differs.
  flat = np.asarray(muon.orthogonalize(jnp.asarray(g.reshape(2, 24, 24)), headwise=False))
  assert not np.allclose(flat.reshape(o.shape), o, atol=1e-2)


@pytest.mark.parametrize("shape", [(40, 16), (16, 40), (2, 3, 24, 24)])
def test_vanilla_matches_polar_with_batch_axes(shape):
  rng = np.random.default_rng(3)
  g = rng.standard_normal(shape).astype(np.float32)
  o = np.asarray(muon.orthogonalize(jnp.asarray(g), headwise=False), np.float64)
  np.testing.assert_allclose(o, refs.polar(g), rtol=0, atol=NS_ATOL)


def test_update_rms_is_018_lr():
  rng = np.random.default_rng(4)
  cfg = _cfg(weight_decay=0.0, lr=0.02)
  params = _params(rng)
  tx = build_optimizer(cfg, params, TABLE)
  u, _ = tx.update(_grads(rng, params), tx.init(params), params)
  for name in ("q", "w"):
    # every matrix of the batch has unit singular values within 5.4e-4
    assert refs.rms(u[name]) == pytest.approx(0.18 * 0.02, rel=6e-4)


def test_bfloat16_iterate_keeps_singular_values_within_1e3():
  """bf16 iterate, float32 accumulation (the accelerator path), on matrices whose spectrum spans
  four decades: every singular value within 1 ± 1e-3 (issue 25 asks 5e-3; the iteration about the
  identity gets the float32 figure, 5.6e-4 here)."""
  rng = np.random.default_rng(5)
  m, n = 96, 48
  u, _ = np.linalg.qr(rng.standard_normal((m, n)))
  v, _ = np.linalg.qr(rng.standard_normal((n, n)))
  g = np.stack([(u * np.logspace(0, -4, n)) @ v.T, rng.standard_normal((m, n))]).astype(np.float32)
  o16 = np.asarray(muon.newton_schulz(jnp.asarray(g), ns_dtype="bfloat16"), np.float64)
  o32 = np.asarray(muon.newton_schulz(jnp.asarray(g), ns_dtype="float32"), np.float64)
  for a in o16:
    s = np.linalg.svd(a, compute_uv=False)
    assert np.all(np.abs(s - 1) < 1e-3), (s.min(), s.max())
  # On the well-conditioned (Gaussian) item the two precisions agree to bf16 rounding; on the
  # decaying spectrum the directions of singular values near 1e-4 are below bf16's resolution.
  assert np.abs(o16[1] - o32[1]).max() < 0.04 / np.sqrt(n), np.abs(o16[1] - o32[1]).max()


def test_frozen_matrices_are_skipped_while_zero_and_equal_otherwise():
  """A frozen batch runs Newton–Schulz under a conditional; a zero direction gives zero, a
  non-zero one the same as if not frozen."""
  rng = np.random.default_rng(6)
  gs = [jnp.asarray(rng.standard_normal((2, 16, 40)), jnp.float32),
        jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)]
  free = muon.orthogonalize_many(gs, [False, False], "float32")
  frozen = jax.jit(lambda gs: muon.orthogonalize_many(gs, [False, False], "float32",
                                                      [False, True]))
  for a, b in zip(frozen(gs), free):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out = frozen([gs[0], jnp.zeros_like(gs[1])])
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(free[0]))
  assert np.all(np.asarray(out[1]) == 0)
  text = frozen.lower(gs).as_text()
  assert text.count("stablehlo.case") + text.count("stablehlo.if") == 1


def test_equal_shapes_share_one_batched_newton_schulz_chain():
  """Every matrix of one shape (head-wise, stacked, from any parameter) is one item of one batch:
  the lowered Newton–Schulz of a shape is three batched products per step (Gram, Aₛ², BX, in the
  loop and in the last step) over all its items, on the short side, a tall batch in its own
  orientation (XᵀX); in the bfloat16 loop Aₛ² and PX are written in bfloat16 (the last step's
  products in float32)."""
  rng = np.random.default_rng(7)
  gs = [jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((2, 40, 3, 16), (2, 3, 40, 16), (40, 16), (2, 16, 40))]  # 13 tall, 2 wide
  text = jax.jit(lambda gs: muon.orthogonalize_many(gs, [True, False, False, False], "bfloat16")
                 ).lower(gs).as_text()
  dots = [line.split("->")[-1].strip() for line in text.splitlines() if "dot_general" in line]
  bodies = refs.lowered_loop_bodies(len(muon.NS_COEFFS) - 1)   # the loop's steps; then the last
  loop = lambda n, m, k: [f"tensor<{n}x{k}x{k}xf32>", f"tensor<{n}x{k}x{k}xbf16>",
                          f"tensor<{n}x{m}xbf16>"] * bodies
  last = lambda n, m, k: [f"tensor<{n}x{k}x{k}xf32>"] * 2 + [f"tensor<{n}x{m}xf32>"]
  per_batch = lambda n, m, k: loop(n, m, k) + last(n, m, k)
  assert sorted(dots) == sorted(per_batch(13, "40x16", 16) + per_batch(2, "16x40", 16)), dots
  assert text.count("stablehlo.while") == 2
  # the only transposes move the head-wise weight's heads next to the batch axes, and back
  assert text.count("stablehlo.transpose") == 2, text.count("stablehlo.transpose")
