"""pallas_kernels/grouped_matmul.py: the custom VJP (XLA products) against jax.grad of ragged_dot,
the Mosaic GPU kernels in interpret mode against a per-group float64 loop, the tile map, and the
bad-input behaviour of the swap point `dsv41_jax.layers.moe_dispatch.grouped_matmul`."""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers import moe_dispatch
from pallas_kernels import dispatch
from pallas_kernels import grouped_matmul as gm


def _skewed_sizes(rng, m_live, g):
  """Group sizes summing to m_live: one hot group, a few empty ones (first and last included)."""
  p = rng.dirichlet(np.full(g, 0.5))
  p[rng.integers(g)] += 2.0
  p[[0, g - 1, rng.integers(1, g - 1)]] = 0.0
  return rng.multinomial(m_live, p / p.sum()).astype(np.int32)


def _loop_reference(x, w, dy, sizes):
  """float64 per-group products: y, dx = dy·wᵀ, dw = xᵀ·dy (rows past Σ sizes: y = dx = 0)."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  y, dx = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x)
  dw = np.zeros_like(w)
  s = 0
  for g, n in enumerate(sizes):
    y[s:s + n] = x[s:s + n] @ w[g]
    dx[s:s + n] = dy[s:s + n] @ w[g].T
    dw[g] = x[s:s + n].T @ dy[s:s + n]
    s += n
  return y, dx, dw


def _value_and_grads(fn, x, w, sizes, r):
  """<fn(x, w, sizes), r> and its gradients in x and w (cotangent of y = r)."""
  loss = lambda x, w: jnp.sum(fn(x, w, sizes) * r)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def _close(got, want64, abs64, n_terms, dtype=jnp.float32):
  """|got − want| ≤ one ulp of `dtype` at want (the final rounding) + n·2⁻²⁴·Σ|terms| (the
  float32 accumulation of n terms; abs64 is the same product of the operands' absolute values)."""
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  _, e = np.frexp(np.maximum(np.abs(want64), np.finfo(np.float32).tiny))
  ulp = np.ldexp(1.0, e - 1 - jnp.finfo(dtype).nmant)
  excess = np.abs(got - want64) - (ulp + n_terms * 2.0**-24 * abs64)
  assert got.shape == want64.shape and np.all(excess <= 0), excess.max()


def _reference(x, w, dy, sizes):
  """(y, dx, dw) of the float64 loop and of the same loop over absolute values."""
  return (_loop_reference(x, w, dy, sizes),
          _loop_reference(*(np.abs(np.asarray(a, np.float64)) for a in (x, w, dy)), sizes))


def test_row_tiles_cover_every_row_once():
  rng = np.random.default_rng(0)
  for m, g, bm in [(1000, 9, 128), (77, 5, 64), (4096, 48, 128)]:
    sizes = _skewed_sizes(rng, m - rng.integers(0, 40), g)
    tiles = jax.jit(gm._row_tiles, static_argnums=(1, 2))(jnp.asarray(sizes), m, bm, False)
    grp, blk, lo, hi = (np.asarray(a) for a in tiles)
    assert len(grp) == -(-m // bm) + g
    owner = np.full(m, -1)
    for t in range(len(grp)):
      rows = np.arange(blk[t] * bm + lo[t], blk[t] * bm + hi[t])
      assert np.all(owner[rows] == -1)  # no row stored twice
      owner[rows] = grp[t]
    want = np.concatenate([np.repeat(np.arange(g), sizes), np.full(m - sizes.sum(), g)])
    np.testing.assert_array_equal(owner, want)  # every row once, by its group (tail = G)


def test_snake_visits_every_tile_once():
  for rows, cols, band in [(5, 6, 2), (1, 1, 1), (7, 4, 4), (3, 6, 3)]:
    r, c = gm._snake(jnp.arange(rows * cols, dtype=jnp.int32), rows, cols, band)
    assert sorted(zip(np.asarray(r).tolist(), np.asarray(c).tolist())) == [
        (i, j) for i in range(rows) for j in range(cols)]


@pytest.mark.parametrize("seed", [0, 1])
def test_custom_vjp_equals_grad_of_ragged_dot(seed):
  # float32: the XLA products are the very ragged_dot contractions jax's own VJP uses, so value
  # and both gradients agree to float32 rounding; the float64 loop is the independent check.
  rng = np.random.default_rng(seed)
  m, k, n, g = 203, 32, 48, 7
  sizes = _skewed_sizes(rng, 190, g)  # 13 tail rows belong to no group
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
  r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  plan = gm.Plan(backend="xla")
  got_v, (got_dx, got_dw) = _value_and_grads(
      lambda x, w, s: gm.grouped_matmul(x, w, s, plan), x, w, jnp.asarray(sizes), r)
  ref_v, (ref_dx, ref_dw) = _value_and_grads(
      lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32),
      x, w, jnp.asarray(sizes), r)
  np.testing.assert_allclose(got_v, ref_v, rtol=1e-6)
  np.testing.assert_allclose(got_dx, ref_dx, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_dw, ref_dw, rtol=1e-6, atol=1e-6)
  (y64, dx64, dw64), (ya, dxa, dwa) = _reference(x, w, r, sizes)
  _close(gm.grouped_matmul(x, w, jnp.asarray(sizes), plan), y64, ya, k)
  _close(got_dx, dx64, dxa, n)
  _close(got_dw, dw64, dwa, int(sizes.max()))
  assert np.all(np.asarray(got_dw)[sizes == 0] == 0)


def test_custom_vjp_bfloat16_rounding_contract():
  # bf16 operands: float32 forward; the cotangent is rounded to bf16 once, each gradient is the
  # float32-accumulated product rounded once to bf16 (one bf16 ulp of the f64 result + the f32
  # accumulation bound).
  rng = np.random.default_rng(2)
  m, k, n, g = 160, 64, 32, 6
  sizes = _skewed_sizes(rng, 150, g)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
  r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  plan = gm.Plan(backend="xla")
  y = gm.grouped_matmul(x, w, jnp.asarray(sizes), plan)
  _, (dx, dw) = _value_and_grads(lambda x, w, s: gm.grouped_matmul(x, w, s, plan), x, w,
                                 jnp.asarray(sizes), r)
  assert y.dtype == jnp.float32 and dx.dtype == dw.dtype == jnp.bfloat16
  (y64, dx64, dw64), (ya, dxa, dwa) = _reference(x, w, r.astype(jnp.bfloat16), sizes)
  _close(y, y64, ya, k)
  _close(dx, dx64, dxa, n, jnp.bfloat16)
  _close(dw, dw64, dwa, int(sizes.max()), jnp.bfloat16)


def test_mosaic_kernels_interpret_match_loop():
  # All three Mosaic GPU kernels through the custom VJP, in interpret mode: 64-row blocks so that
  # groups straddle blocks, a single-row group, empty groups at both ends, a tail of 15 rows, and
  # 3 persistent programs for 5 row tiles × 2 column tiles.
  rng = np.random.default_rng(3)
  m, k, n, g = 256, 128, 128, 6
  sizes = np.array([0, 70, 1, 106, 64, 0], np.int32)  # 241 rows in groups
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
  r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  cfg = gm.TileConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=2)
  plan = gm.Plan(forward=cfg, input_grad=cfg, weight_grad=cfg, num_sms=3, interpret=True)
  assert gm.unsupported_reason(x, w, plan) is None
  y = gm.grouped_matmul(x, w, jnp.asarray(sizes), plan)
  _, (dx, dw) = _value_and_grads(lambda x, w, s: gm.grouped_matmul(x, w, s, plan), x, w,
                                 jnp.asarray(sizes), r)
  (y64, dx64, dw64), (ya, dxa, dwa) = _reference(x, w, r.astype(jnp.bfloat16), sizes)
  _close(y, y64, ya, k)
  assert np.all(np.asarray(y)[241:] == 0) and np.all(np.asarray(dx, np.float32)[241:] == 0)
  _close(dx, dx64, dxa, n, jnp.bfloat16)
  _close(dw, dw64, dwa, int(sizes.max()), jnp.bfloat16)
  assert np.all(np.asarray(dw, np.float32)[[0, 5]] == 0)


@pytest.mark.parametrize("num_sms, n", [(3, 256), (8, 128)])
def test_warp_specialized_row_kernels_interpret_match_loop(num_sms, n):
  # TileConfig.compute_wgs=2 for the forward (float32 and bf16 out) and the input gradient, in
  # interpret mode: two consumer warpgroups on 64-column halves of 128-column tiles, 2 K steps in a
  # 3-deep budget (so 2-deep chains). 3 programs for 7 product row tiles x 2 column tiles chain
  # several items (START, STEADY, STOP); 8 programs for 7 x 1 give each at most one (the plain
  # pipeline).
  # Groups straddle blocks, a single-row group, empty groups at both ends, a 15-row tail; bad
  # sizes poison every output.
  rng = np.random.default_rng(7)
  m, k, g = 256, 128, 6
  sizes = np.array([0, 70, 1, 106, 64, 0], np.int32)  # 241 rows in groups
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  cfg = gm.TileConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=3, compute_wgs=2)
  plan = gm.Plan(forward=cfg, forward_narrow=cfg, input_grad=cfg, num_sms=num_sms,
                 interpret=True)
  assert gm.unsupported_reason(x, w, plan) is None and gm._chain_stages(k // 64, 3) == 2
  s = jnp.asarray(sizes)
  (y64, dx64, _), (ya, dxa, _) = _reference(x, w, dy, sizes)
  y = gm._mgpu_forward(x, w, s, plan)
  _close(y, y64, ya, k)
  assert np.all(np.asarray(y)[241:] == 0)
  narrow = gm._mgpu_forward(x, w, s, plan, out_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(narrow, np.float32),
                                np.asarray(y.astype(jnp.bfloat16), np.float32))
  dx = gm._mgpu_input_grad(dy, w, s, plan)
  _close(dx, dx64, dxa, n, jnp.bfloat16)
  assert np.all(np.asarray(dx, np.float32)[241:] == 0)
  bad = jnp.asarray([0, 70, 1, 106, 64, 16], jnp.int32)   # 257 > 256 rows
  assert np.all(np.isnan(np.asarray(gm._mgpu_forward(x, w, bad, plan, out_dtype=jnp.bfloat16),
                                    np.float32)))
  assert np.all(np.isnan(np.asarray(gm._mgpu_input_grad(dy, w, bad, plan), np.float32)))
  odd = dataclasses.replace(plan, input_grad=dataclasses.replace(cfg, block_n=96))
  assert "input_grad" in gm.unsupported_reason(x, w, odd)
  # n a multiple of block_n but not of the two consumers' 2·block_n: the single-warpgroup kernel
  assert gm.warp_specialized(cfg, 128) and not gm.warp_specialized(cfg, 192)
  assert not gm.warp_specialized(dataclasses.replace(cfg, compute_wgs=1), 128)
  tiles = gm._row_tiles(s, m, 64, jnp.asarray(False))
  assert int(jnp.sum(tiles[0] < g)) == 7


@pytest.mark.parametrize("num_sms", [3, 16])
def test_warp_specialized_weight_grad_interpret_matches_loop(num_sms):
  # TileConfig.compute_wgs=2 for the weight gradient, in interpret mode: two consumers on 64-column
  # halves of 128-column tiles, over each group's rows in 64-row blocks from the block-aligned
  # start (groups straddle blocks: both ends masked, both in one block for the single-row group;
  # rows of a neighbouring group hold NaN in x and dy, which must not leak), a 3-deep pipeline on
  # groups of 1 to 3 blocks (dynamic step counts, shorter than the depth), 2 K tiles x 1 N tile a
  # group; empty groups store zeros; 3 programs (several items each, one pipeline after another)
  # and 16 (at most one). Bad sizes poison every output.
  rng = np.random.default_rng(11)
  m, k, n, g = 256, 128, 128, 6
  sizes = np.array([0, 70, 1, 106, 64, 0], np.int32)  # 241 rows in groups, a 15-row tail
  x = rng.standard_normal((m, k))
  dy = rng.standard_normal((m, n))
  cfg = gm.TileConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=3, compute_wgs=2)
  plan = gm.Plan(weight_grad=cfg, num_sms=num_sms, interpret=True)
  xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
  w = jnp.zeros((g, k, n), jnp.bfloat16)
  assert gm.unsupported_reason(xb, w, plan) is None and gm.warp_specialized(cfg, n)
  s = jnp.asarray(sizes)
  (_, _, dw64), (_, _, dwa) = _reference(xb, w, dyb, sizes)
  dw = gm._mgpu_weight_grad(xb, dyb, s, plan)
  _close(dw, dw64, dwa, int(sizes.max()), jnp.bfloat16)
  assert np.all(np.asarray(dw, np.float32)[[0, 5]] == 0)
  # The single-warpgroup kernel with the same blocks: the same sums in the same order
  one = gm._mgpu_weight_grad(xb, dyb, s, dataclasses.replace(plan, weight_grad=dataclasses.replace(
      cfg, compute_wgs=1)))
  np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(one, np.float32))
  # NaN in the rows of group 3 (rows 71..176) stays in group 3's gradient
  poisoned = x.copy()
  poisoned[100] = np.nan
  dw_p = np.asarray(gm._mgpu_weight_grad(jnp.asarray(poisoned, jnp.bfloat16), dyb, s, plan),
                    np.float32)
  assert np.all(np.isnan(dw_p[3])) and not np.any(np.isnan(np.delete(dw_p, 3, axis=0)))
  np.testing.assert_array_equal(np.delete(dw_p, 3, axis=0),
                                np.delete(np.asarray(dw, np.float32), 3, axis=0))
  bad = jnp.asarray([0, 70, 1, 106, 64, 16], jnp.int32)   # 257 > 256 rows
  assert np.all(np.isnan(np.asarray(gm._mgpu_weight_grad(xb, dyb, bad, plan), np.float32)))


def test_kernels_lower_for_cuda_at_the_expert_shapes():
  # What interpret mode cannot see: the Pallas -> Mosaic GPU lowering of every product at s3's
  # expert shapes, single-warpgroup and warp-specialized, for an H200 (no GPU needed; ptxas and the
  # run itself stay the GPU's to check). One Mosaic GPU kernel a product.
  from tests.pallas_kernels.cuda_lowering import lower_for_cuda
  m, k, n, g = 65536, 1024, 512, 48
  x, dy = (jax.ShapeDtypeStruct((m, c), jnp.bfloat16) for c in (k, n))
  w = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((g,), jnp.int32)
  one = gm.TileConfig(128, 128, 64, 6, 1)
  two = gm.TileConfig(128, 128, 64, 4, 1, compute_wgs=2)
  for cfg in (one, two):
    plan = gm.Plan(forward=cfg, forward_narrow=cfg, input_grad=cfg, weight_grad=cfg, num_sms=132)
    for fn, args in ((lambda a, b, c: gm._mgpu_forward(a, b, c, plan, out_dtype=jnp.bfloat16),
                      (x, w, s)),
                     (lambda a, b, c: gm._mgpu_input_grad(a, b, c, plan), (dy, w, s)),
                     (lambda a, b, c: gm._mgpu_weight_grad(a, b, c, plan), (x, dy, s))):
      text = lower_for_cuda(fn, *args).as_text()
      assert len(re.findall(r"custom_call @mosaic_gpu\w*\(", text)) == 1, cfg


@pytest.mark.parametrize("backend", ["xla", "mosaic_gpu"])
def test_output_in_x_dtype_is_the_float32_output_rounded_once(backend):
  # out_dtype=bf16: the same float32 accumulator rounded once at the store (bit for bit the float32
  # output's rounding, NaN rows included); its cotangent arrives in bf16, so the backward equals the
  # float32-output backward fed that cotangent (which rounds it to bf16 first) bit for bit. The
  # Mosaic kernels in interpret mode with the narrow forward's own blocks.
  rng = np.random.default_rng(4)
  m, k, n, g = 256, 128, 128, 5
  sizes = np.array([0, 90, 1, 120, 30], np.int32)   # 241 rows in groups
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
  r = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  cfg = gm.TileConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=2)
  narrow = gm.TileConfig(block_m=64, block_n=128, block_k=64, max_concurrent_steps=3)
  plan = (gm.Plan(backend="xla") if backend == "xla" else
          gm.Plan(forward=cfg, forward_narrow=narrow, input_grad=cfg, weight_grad=cfg, num_sms=3,
                  interpret=True))
  s = jnp.asarray(sizes)
  wide = gm.grouped_matmul(x, w, s, plan)
  y = gm.grouped_matmul(x, w, s, plan, out_dtype=jnp.bfloat16)
  assert wide.dtype == jnp.float32 and y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(wide.astype(jnp.bfloat16),
                                                                     np.float32))
  grads = lambda out: jax.jit(jax.grad(
      lambda x, w: jnp.sum(gm.grouped_matmul(x, w, s, plan, out_dtype=out).astype(jnp.float32)
                           * r.astype(jnp.float32)), argnums=(0, 1)))(x, w)
  for a, b in zip(grads(jnp.bfloat16), grads(jnp.float32)):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  bad = jnp.asarray([0, 90, -1, 120, 30], jnp.int32)      # traced: the product is NaN, not wrong
  poisoned = jax.jit(lambda s: gm.grouped_matmul(x, w, s, plan, out_dtype=jnp.bfloat16))(bad)
  assert poisoned.dtype == jnp.bfloat16 and np.all(np.isnan(np.asarray(poisoned, np.float32)))
  with pytest.raises(ValueError, match="out_dtype"):
    gm.grouped_matmul(x, w, s, plan, out_dtype=jnp.float16)
  if backend == "mosaic_gpu":   # the narrow forward's blocks are checked as its own
    odd = dataclasses.replace(plan, forward_narrow=gm.TileConfig(block_n=96))
    assert "forward_narrow" in gm.unsupported_reason(x, w, odd)


def test_bad_group_sizes_raise_or_poison():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
  for sizes in ([10, -2, 20], [20, 20, 5]):  # negative; sums past the 40 rows
    with pytest.raises(ValueError, match="group sizes"):
      gm.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), gm.Plan(backend="xla"))
    with pytest.raises(ValueError, match="group sizes"):
      moe_dispatch.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), policy="reference")
    traced = jnp.asarray(sizes, jnp.int32)
    for f in (lambda s: gm.grouped_matmul(x, w, s, gm.Plan(backend="xla")),
              lambda s: moe_dispatch.grouped_matmul(x, w, s, policy="reference")):
      assert np.all(np.isnan(jax.jit(f)(traced)))
    grads = jax.jit(jax.grad(lambda x, w, s: jnp.sum(gm.grouped_matmul(x, w, s, gm.Plan("xla"))),
                             argnums=(0, 1)))(x, w, traced)
    assert all(np.all(np.isnan(a)) for a in grads)


def test_bad_group_sizes_poison_the_kernels():
  x = jnp.ones((64, 64), jnp.bfloat16)
  w = jnp.ones((2, 64, 64), jnp.bfloat16)
  cfg = gm.TileConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2)
  plan = gm.Plan(forward=cfg, input_grad=cfg, weight_grad=cfg, num_sms=2, interpret=True)
  sizes = jnp.asarray([40, 30], jnp.int32)  # 70 > 64 rows
  assert np.all(np.isnan(gm._mgpu_forward(x, w, sizes, plan)))
  assert np.all(np.isnan(np.asarray(gm._mgpu_weight_grad(x, x, sizes, plan), np.float32)))


def test_swap_point_picks_by_backend_and_logs_fallback(caplog):
  # The decision is logged once per process: forget earlier tests' notices (order-independent).
  from pallas_kernels import notices
  notices._NOTED.clear()
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((30, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)
  sizes = jnp.asarray([5, 0, 20, 3], jnp.int32)
  want = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
  # float32 operands: the wgmma kernels cannot take them; "auto" says so once and runs ragged_dot
  with caplog.at_level(logging.INFO):
    got = moe_dispatch.grouped_matmul(x, w, sizes, policy="auto")
  assert "grouped_matmul" in caplog.text and "bf16 or f16" in caplog.text
  assert dispatch.choose("grouped_matmul", "auto", x, w, sizes)[0] == (
      "pallas_kernels.ops.grouped_matmul:grouped_matmul")
  np.testing.assert_array_equal(got, want)
  with pytest.raises(dispatch.PolicyError, match="op grouped_matmul: policy 'kernel'.*bf16 or f16"):
    moe_dispatch.grouped_matmul(x, w, sizes, policy="kernel")
  with pytest.raises(ValueError, match="policy 'cutlass'"):
    moe_dispatch.grouped_matmul(x, w, sizes, policy="cutlass")


def test_out_of_range_expert_ids_raise_or_poison_their_tokens():
  rng = np.random.default_rng(6)
  b, t, d, e, f, k = 2, 5, 16, 4, 8, 2
  x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (b, t, k)), jnp.float32)
  experts = np.stack([rng.permutation(e)[:k] for _ in range(b * t)]).reshape(b, t, k)
  valid = np.ones((b, t), bool)
  valid[1, 4] = False
  w1, w3 = (jnp.asarray(rng.standard_normal((e, d, f)), jnp.float32) for _ in range(2))
  w2 = jnp.asarray(rng.standard_normal((e, f, d)), jnp.float32)
  bad = experts.copy()
  bad[0, 1, 0], bad[1, 2, 1], bad[1, 4, 0] = -1, e, e + 3  # the last one is a padding token
  for mode in ("dropless", "capacity"):
    kw = dict(mode=mode, capacity_factor=float(e) / k)
    with pytest.raises(ValueError, match="expert ids"):
      moe_dispatch.routed_experts(x, weights, jnp.asarray(bad), jnp.asarray(valid), w1, w3, w2,
                                  **kw)
    run = jax.jit(lambda ids: moe_dispatch.routed_experts(x, weights, ids, jnp.asarray(valid),
                                                          w1, w3, w2, **kw)[0])
    y_bad, y_ok = np.asarray(run(jnp.asarray(bad))), np.asarray(run(jnp.asarray(experts)))
    poisoned = np.zeros((b, t), bool)
    poisoned[0, 1] = poisoned[1, 2] = True
    assert np.all(np.isnan(y_bad[poisoned]))
    np.testing.assert_array_equal(y_bad[~poisoned], y_ok[~poisoned])
