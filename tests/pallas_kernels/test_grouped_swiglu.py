"""pallas_kernels/grouped_swiglu.py: the fused gate/up GEMM + SwiGLU kernel in Mosaic GPU interpret
mode against the op's reference (`pallas_kernels.ops.grouped_swiglu`), the grouped GEMM kernel
it replaces and a per-group float64 loop; its custom VJP against the unfused path and `jax.grad`
of the reference; bad input; the dispatcher's rules and `moe_dispatch.grouped_ffn`'s swap."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers import moe_dispatch
from pallas_kernels import dispatch
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import grouped_swiglu as gs
from pallas_kernels.ops import grouped_swiglu as ops

LIMIT = 3.0
# 64-row blocks so that groups straddle blocks; 3 persistent programs over 4 row blocks × 2
# column tiles (+ the visits of straddling groups)
CFG = gm.TileConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=2)
PLAN = gs.Plan(fused=CFG, products=gm.Plan(forward=CFG, forward_narrow=CFG, input_grad=CFG,
                                           weight_grad=CFG, num_sms=3, interpret=True))
# 200 rows (not a multiple of 64), 191 in groups: empty experts first, last and inside, a group of
# one row, boundaries inside row blocks
SIZES = np.array([0, 70, 1, 0, 100, 20, 0], np.int32)
M, K, F = 200, 128, 128


def _inputs(seed, m=M, k=K, f=F, g=len(SIZES)):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  # |a|, |u| of a few units: the clamp at LIMIT acts on some entries, SiLU's curve on the rest
  w = jnp.asarray(rng.standard_normal((g, k, 2 * f)) * 2 / np.sqrt(k), jnp.bfloat16)
  weight = jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32)
  return x, w, weight


def _ulp(want64, dtype):
  _, e = np.frexp(np.maximum(np.abs(want64), np.finfo(np.float32).tiny))
  return np.ldexp(1.0, e - 1 - jnp.finfo(dtype).nmant)


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _loop64(x, w, weight, sizes, au_rounded):
  """float64 per-group [a | u] (and |x|·|w| for the accumulation bound), and h from the kernel's
  rounded [a | u] in float64; rows past Σ sizes are 0."""
  x, w, weight = _f64(x), _f64(w), _f64(weight)
  au, au_abs = np.zeros((x.shape[0], w.shape[2])), np.zeros((x.shape[0], w.shape[2]))
  s = 0
  for e, n in enumerate(sizes):
    au[s:s + n] = x[s:s + n] @ w[e]
    au_abs[s:s + n] = np.abs(x[s:s + n]) @ np.abs(w[e])
    s += n
  f = w.shape[2] // 2
  a, u = np.minimum(au_rounded[:, :f], LIMIT), np.clip(au_rounded[:, f:], -LIMIT, LIMIT)
  return au, au_abs, a / (1 + np.exp(-a)) * u * weight[:, None]


@pytest.mark.parametrize("gate_up_dtype", [jnp.bfloat16, jnp.float32])
def test_fused_forward_matches_the_grouped_gemm_reference_and_float64(gate_up_dtype):
  x, w, weight = _inputs(0)
  sizes = jnp.asarray(SIZES)
  assert gs.unsupported_reason(x, w, gate_up_dtype, PLAN) is None
  h, au = gs.grouped_swiglu(x, w, weight, sizes, PLAN, limit=LIMIT, gate_up_dtype=gate_up_dtype)
  assert h.shape == (M, F) and h.dtype == x.dtype and au.dtype == jnp.dtype(gate_up_dtype)
  # [a | u]: the grouped GEMM kernel's output in gate_up_dtype, bit for bit (the same K loop)
  au_gemm = gm.grouped_matmul(x, w, sizes, PLAN.products, out_dtype=gate_up_dtype)
  np.testing.assert_array_equal(_f64(au), _f64(au_gemm))
  # h within one ulp of x's dtype of `weighted_swiglu` of those rounded values (the GPU's
  # logistic may round otherwise than XLA's; interpreted on the CPU it is the same arithmetic)
  h_ref = _f64(ops.weighted_swiglu(au, weight, LIMIT, x.dtype))
  assert np.all(np.abs(_f64(h) - h_ref) <= _ulp(h_ref, x.dtype) * (h_ref != 0))
  # the op's reference (ragged_dot): [a | u] to one ulp of gate_up_dtype plus float32 accumulation
  h_op, au_op = ops.grouped_swiglu(x, w, weight, sizes, limit=LIMIT, gate_up_dtype=gate_up_dtype)
  au64, au_abs, h64 = _loop64(x, w, weight, SIZES, _f64(au))
  for got in (au, au_op):
    excess = np.abs(_f64(got) - au64) - (_ulp(au64, gate_up_dtype) + K * 2.0**-24 * au_abs)
    assert np.all(excess <= 0), excess.max()
  # h against float64 SwiGLU of the kernel's rounded [a | u]: one ulp of x's dtype (its rounding,
  # with float32 arithmetic's few ulps far inside the remaining half ulp)
  assert np.all(np.abs(_f64(h) - h64) <= _ulp(h64, x.dtype))
  assert h_op.dtype == h.dtype and au_op.dtype == au.dtype
  # rows past Σ sizes: zero in both outputs
  live = int(SIZES.sum())
  assert np.all(_f64(h)[live:] == 0) and np.all(_f64(au)[live:] == 0)


def _unfused(plan):
  """Today's path: the grouped GEMM kernel to [a | u], then `weighted_swiglu`."""
  def run(x, w, weight, sizes, gate_up_dtype):
    au = gm.grouped_matmul(x, w, sizes, plan, out_dtype=gate_up_dtype)
    return ops.weighted_swiglu(au, weight, LIMIT, x.dtype), au
  return run


def _grads(fn, x, w, weight, sizes, gate_up_dtype, r):
  """Gradients in x, w and weight of <h, r> (h from fn(...)[0])."""
  loss = lambda x, w, g: jnp.sum(fn(x, w, g, sizes, gate_up_dtype)[0].astype(jnp.float32) * r)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, weight)


@pytest.mark.parametrize("gate_up_dtype", [jnp.bfloat16, jnp.float32])
def test_fused_gradients_equal_the_unfused_path_and_the_reference(gate_up_dtype):
  x, w, weight = _inputs(1)
  sizes = jnp.asarray(SIZES)
  r = jnp.asarray(np.random.default_rng(2).standard_normal((M, F)), jnp.float32)
  fused = lambda x, w, g, s, dt: gs.grouped_swiglu(x, w, g, s, PLAN, limit=LIMIT,  # noqa: E731
                                                   gate_up_dtype=dt)
  got = _grads(fused, x, w, weight, sizes, gate_up_dtype, r)
  # The same backward math as the unfused kernel path, on the same [a | u]: bit for bit.
  for a, b in zip(got, _grads(_unfused(PLAN.products), x, w, weight, sizes, gate_up_dtype, r)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(_f64(a), _f64(b))
  assert [a.dtype for a in got] == [x.dtype, w.dtype, weight.dtype]
  # jax.grad of the op's reference (ragged_dot, autodiff): its [a | u] rounds its own float32
  # sums, so d[a | u] may land one ulp of x's dtype apart before both products (bound: one such
  # ulp on every term, |dy|·|w| and |x|·|dy|, plus the result's rounding); g's float32 gradient
  # Σ_f dh·s to 2⁻⁸ of Σ_f |dh·s| (s of [a | u] one ulp of gate_up_dtype apart, SiLU's slope ≤ 1.1).
  reference = lambda x, w, g, s, dt: ops.grouped_swiglu(x, w, g, s, limit=LIMIT,  # noqa: E731
                                                        gate_up_dtype=dt)
  ref = _grads(reference, x, w, weight, sizes, gate_up_dtype, r)
  dy_abs = np.zeros((M, 2 * F))
  dy_abs[:int(SIZES.sum())] = 8 * LIMIT * np.abs(np.asarray(r))[:int(SIZES.sum())].repeat(2, 1)
  x64, w64 = np.abs(_f64(x)), np.abs(_f64(w))
  bounds, s = [np.zeros((M, K)), np.zeros(w.shape)], 0
  for e, n in enumerate(SIZES):
    bounds[0][s:s + n] = dy_abs[s:s + n] @ w64[e].T
    bounds[1][e] = x64[s:s + n].T @ dy_abs[s:s + n]
    s += n
  for got_i, ref_i, bound in zip(got[:2], ref[:2], bounds):
    assert np.all(np.abs(_f64(got_i) - _f64(ref_i))
                  <= 2.0**-8 * bound + 2 * _ulp(_f64(ref_i), jnp.bfloat16)), got_i.shape
  g_bound = 2.0**-8 * 1.1 * LIMIT * np.abs(np.asarray(r)).sum(axis=1)
  assert np.all(np.abs(_f64(got[2]) - _f64(ref[2])) <= g_bound + 1e-6)
  assert np.all(_f64(got[2])[int(SIZES.sum()):] == 0)
  assert np.all(_f64(got[1])[SIZES == 0] == 0)


def test_bad_group_sizes_raise_or_poison():
  x, w, weight = _inputs(3)
  for bad in ([0, 70, 1, 0, 100, 40, 0], [0, 70, -1, 0, 100, 20, 0]):  # past M; negative
    with pytest.raises(ValueError, match="group sizes"):
      gs.grouped_swiglu(x, w, weight, jnp.asarray(bad, jnp.int32), PLAN, limit=LIMIT)
    h, au = jax.jit(lambda s: gs.grouped_swiglu(x, w, weight, s, PLAN, limit=LIMIT,
                                                gate_up_dtype=jnp.bfloat16))(
        jnp.asarray(bad, jnp.int32))
    assert np.all(np.isnan(_f64(h))) and np.all(np.isnan(_f64(au)))


def test_unsupported_shapes_are_named_and_auto_falls_back(caplog):
  x, w, weight = _inputs(4, f=96, k=64)           # F = 96: not a multiple of block_n 64
  sizes = jnp.asarray([30, 0, 150, 20], jnp.int32)
  w = w[:4]
  reason = gs.unsupported_reason(x, w, jnp.bfloat16, PLAN)   # [w1 | w3]'s 192 columns pass
  assert reason.startswith("fused: h's width 96") and "block_n 64" in reason
  assert "[a | u] in float16" in gs.unsupported_reason(*_inputs(4)[:2], jnp.float16, PLAN)
  static = dict(limit=LIMIT, gate_up_dtype=jnp.bfloat16)
  with pytest.raises(dispatch.PolicyError, match="op grouped_swiglu: policy 'kernel'"):
    dispatch.call("grouped_swiglu", x, w, weight, sizes, policy="kernel", **static)
  from pallas_kernels import notices
  notices._NOTED.clear()
  with caplog.at_level(logging.INFO):
    h, au = dispatch.call("grouped_swiglu", x, w, weight, sizes, policy="auto", **static)
  assert "grouped_swiglu" in caplog.text and "runs the reference" in caplog.text
  want_h, want_au = ops.grouped_swiglu(x, w, weight, sizes, **static)
  np.testing.assert_array_equal(_f64(h), _f64(want_h))
  np.testing.assert_array_equal(_f64(au), _f64(want_au))


def test_auto_keeps_the_unfused_path_until_measured():
  # the kernel can run here (interpreted), but "auto" takes it nowhere: not measured faster
  x, w, weight = _inputs(5)
  args = (x, w, weight, jnp.asarray(SIZES))
  static = dict(limit=LIMIT, gate_up_dtype=jnp.bfloat16)
  assert gs.op_unsupported_reason(*args, **static) is None
  for backend in ("gpu", "cpu"):
    assert dispatch.implementation("grouped_swiglu", "auto", *args, backend=backend, **static) == (
        "pallas_kernels.ops.grouped_swiglu:grouped_swiglu")
  assert dispatch.choose("grouped_swiglu", "kernel", *args, **static)[0] == (
      "pallas_kernels.grouped_swiglu:mosaic_grouped_swiglu")


def test_grouped_ffn_takes_the_kernel_under_its_policy():
  # moe_dispatch.grouped_ffn with (w1, w3) as `gate_up_pair`'s form, the op's own plan (128-row
  # blocks, 256 rows): "kernel" runs the fused kernel, whose h and gradients equal the unfused
  # kernel path ("reference" for grouped_swiglu, "kernel" for the grouped GEMMs) bit for bit.
  rng = np.random.default_rng(6)
  p, d, f, e = 256, 128, 128, 5
  sizes = jnp.asarray([0, 90, 1, 140, 0], jnp.int32)
  x = jnp.asarray(rng.standard_normal((p, d)), jnp.bfloat16)
  w1, w3 = (jnp.asarray(rng.standard_normal((e, d, f)) * 2 / np.sqrt(d), jnp.float32)
            for _ in "ab")
  w2 = jnp.asarray(rng.standard_normal((e, f, d)) / np.sqrt(f), jnp.float32)
  pair, empty = moe_dispatch.gate_up_pair(w1, w3)
  weight = jnp.asarray(rng.uniform(0.05, 1.0, p), jnp.float32)

  def run(swiglu_policy):
    def loss(x, pair, w2, weight):
      y = moe_dispatch.grouped_ffn(x, weight, pair, empty, w2, sizes, LIMIT, "kernel",
                                   jnp.bfloat16, jnp.bfloat16, swiglu_policy)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, pair, w2, weight)

  (_, y_fused), g_fused = run("kernel")
  (_, y_two), g_two = run("reference")
  for a, b in zip(jax.tree.leaves((y_fused, g_fused)), jax.tree.leaves((y_two, g_two))):
    np.testing.assert_array_equal(_f64(a), _f64(b))
