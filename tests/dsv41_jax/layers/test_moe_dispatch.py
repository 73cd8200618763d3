"""dsv41_jax/layers/moe_dispatch.py (docs/design.md §8.2, §T1): dropless and capacity dispatch of
the routed experts against a dense float64 loop, the capacity drop rule restated, expert
parallelism equal to one device, and the routing weight applied before the down-projection."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import testing
from dsv41_jax.layers import moe_dispatch
from dsv41_jax.layers.moe import MoE
from tests.dsv41_jax.layers.test_moe import (D, E, F, K, LIMIT, call_moe, moe_cfg, moe_inputs,
                                             moe_params, np_moe, np_route)


def _np_capacity_drops(sel, valid, capacity):
  """The drop rule restated: slot-major order (all first choices, then second ...), token order."""
  b, t, k = sel.shape
  sel = sel.reshape(b * t, k)
  valid = valid.reshape(b * t)
  count = np.zeros(E, int)
  dropped = np.zeros((b * t, k), bool)
  for kk in range(k):
    for n in range(b * t):
      if not valid[n]:
        continue
      e = sel[n, kk]
      if count[e] < capacity:
        count[e] += 1
      else:
        dropped[n, kk] = True
  return dropped.reshape(b, t, k)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_dispatch_equals_dense_loop(mode):
  # capacity_factor E/K makes C = n: the worst case, so nothing may drop
  cfg = moe_cfg(moe_dispatch=mode, moe_capacity_factor=E / K)
  model = MoE(cfg, nnx.Rngs(1))
  x, seg, image, bias = moe_inputs(1)
  y, aux = call_moe(model, x, seg, image, bias)
  p = moe_params(model)
  w, sel, _ = np_route(x, p["router"], bias, image, K, cfg.routed_scaling_factor, cfg.gate_temp)
  ref = np_moe(p, x, w, sel, seg != 0, LIMIT)
  # the clamps are exercised
  assert np.mean(np.abs(x.reshape(-1, D) @ p["w1"][0]) > LIMIT) > 0.05
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=2e-6)
  assert float(aux["dropped_fraction"]) == 0.0


def test_capacity_drops_exactly_the_numpy_rule():
  cfg = moe_cfg(moe_dispatch="capacity", moe_capacity_factor=0.75, n_shared_experts=0)
  model = MoE(cfg, nnx.Rngs(2))
  x, seg, image, bias = moe_inputs(2)
  bias[0] += np.array([1.0, 0.6, 0, 0, 0, 0, 0, 0], np.float32)  # unbalanced text load
  p = moe_params(model)
  w, sel, _ = np_route(x, p["router"], bias, image, K, cfg.routed_scaling_factor, cfg.gate_temp)
  valid = seg != 0
  n = x.shape[0] * x.shape[1]
  capacity = moe_dispatch.expert_capacity(n, K, E, 0.75)
  assert capacity == math.ceil(0.75 * n * K / E)
  want = _np_capacity_drops(sel, valid, capacity)
  assert want.sum() >= 4

  y_r, dropped = moe_dispatch.routed_experts(
      jnp.asarray(x), jnp.asarray(w, jnp.float32), jnp.asarray(sel, jnp.int32), jnp.asarray(valid),
      model.experts.w1[...], model.experts.w3[...], model.experts.w2[...], mode="capacity",
      capacity_factor=0.75, swiglu_limit=LIMIT)
  np.testing.assert_array_equal(np.asarray(dropped), want)
  np.testing.assert_allclose(np.asarray(y_r), np_moe(p, x, w, sel, valid, LIMIT, want),
                             rtol=1e-5, atol=2e-6)

  y, aux = call_moe(model, x, seg, image, bias)
  np.testing.assert_allclose(np.asarray(y), np_moe(p, x, w, sel, valid, LIMIT, want),
                             rtol=1e-5, atol=2e-6)
  assert float(aux["dropped_fraction"]) == pytest.approx(want.sum() / (valid.sum() * K), rel=1e-6)


AUX_KEYS = ("balance_loss", "load_2xE", "dropped_fraction")


def _with_grads(loss):
  """Values and gradients w.r.t. (params, x) of `loss(state, x, ...) -> (scalar, (y, aux))`."""
  def fn(state, x, *rest):
    (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x, *rest)
    return {"y": y, "aux": {k: aux[k] for k in AUX_KEYS}, "grads": grads}
  return fn


@pytest.mark.parametrize("mode,mesh_shape", [
    ("dropless", {"data": 2, "expert": 4}),
    ("capacity", {"data": 2, "expert": 4}),
    ("dropless", {"fsdp": 2, "expert": 2, "tensor": 2}),  # + gathered fsdp, psum over tensor
])
def test_expert_parallel_equals_single_device(mode, mesh_shape):
  """Tokens go to their experts' owners by all-to-all and come back; values and gradients.

  Capacity is per batch shard (one device), so the reference runs the single-device path on
  each shard's rows (one row each on data 2 × expert 4); 0.75 makes pairs drop there.
  Dropless compares with the whole batch at once.
  """
  cf = 0.75
  cfg = moe_cfg(moe_dispatch=mode, moe_capacity_factor=cf)
  model = MoE(cfg, nnx.Rngs(4))
  x, seg, image, bias = moe_inputs(4, b=8, t=4)
  seg[3, 1] = 0
  r = np.random.default_rng(5).normal(size=x.shape).astype(np.float32)
  graphdef, state = nnx.split(model)

  def loss(state, x, seg, image, bias, r):
    y, aux = nnx.merge(graphdef, state)(x, segment_ids_BxT=seg, image_mask_BxT=image,
                                        bias_2xE=bias)
    return (y * r).sum() + aux["balance_loss"], (y, aux)

  reference = None
  if mode == "capacity":
    # same per-shard rule, computed shard by shard on one device
    def reference_loss(state, x, seg, image, bias, r):
      m = nnx.merge(graphdef, state)
      def one_row(row):
        x_r, seg_r, image_r = (a[None] for a in row)
        y, aux = m(x_r, segment_ids_BxT=seg_r, image_mask_BxT=image_r, bias_2xE=bias)
        return y[0], aux["dropped_fraction"] * (seg_r != 0).sum() * K
      y, drops = jax.lax.map(one_row, (x, seg, image))
      _, aux = m(x, segment_ids_BxT=seg, image_mask_BxT=image, bias_2xE=bias)
      aux = dict(aux, dropped_fraction=drops.sum() / ((seg != 0).sum() * K))
      return (y * r).sum() + aux["balance_loss"], (y, aux)
    reference = _with_grads(reference_loss)

  grads = lambda path: path.startswith("['grads']")
  result = testing.assert_sharded_matches(
      _with_grads(loss), (state, x, seg, image, bias, r), testing.cpu_mesh(mesh_shape),
      in_specs=("params", "batch", "batch", "batch", None, "batch"), reference_fn=reference,
      rtol=lambda path, _: 1e-5 if grads(path) else 1e-6,
      atol=lambda path, _: 0.0 if path.startswith("['aux']") else 1e-6)

  if mode == "capacity":
    assert float(result.single["aux"]["dropped_fraction"]) > 0.05
  flat_1 = jax.tree.leaves(result.single["grads"])
  assert len(flat_1) == 8  # 7 parameters and x
  assert all(np.abs(np.asarray(b)).max() > 0 for b in flat_1)


def rb(a):
  """a rounded to bf16, as float64."""
  return np.asarray(a, np.float64).astype(jnp.bfloat16.dtype).astype(np.float64)


def _official_case(seed, b=4, t=8):
  """bf16-representable x [b, t, D] and expert weights (float64), K distinct experts per token,
  routing weights, every token valid."""
  rng = np.random.default_rng(seed)
  x = rb(rng.normal(size=(b, t, D)) * 1.5)
  w1, w3 = (rb(rng.normal(size=(E, D, F)) / 4) for _ in range(2))
  w2 = rb(rng.normal(size=(E, F, D)) / np.sqrt(F))
  sel = np.stack([rng.permutation(E)[:K] for _ in range(b * t)]).reshape(b, t, K)
  g = rng.uniform(0.2, 1.3, size=(b, t, K)).astype(np.float32)
  return x, w1, w3, w2, sel, g, np.ones((b, t), bool)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_routing_weight_scales_the_activation_before_w2_in_bf16(mode):
  """The official V4 order, W2 (g · SiLU(a) ⊙ u) with the weighted activation rounded to bf16,
  restated in float64; weighting W2's output instead differs by ~1e-2 here."""
  x, w1, w3, w2, sel, g, valid = _official_case(11)
  valid[1, 5:] = False
  b, t = valid.shape

  def ref(weight_first):
    y = np.zeros((b, t, D))
    for i, j, k in np.ndindex(b, t, K):
      if valid[i, j]:
        e = sel[i, j, k]
        a = np.minimum(x[i, j] @ w1[e], LIMIT)
        h = a / (1 + np.exp(-a)) * np.clip(x[i, j] @ w3[e], -LIMIT, LIMIT)
        y[i, j] += rb(g[i, j, k] * h) @ w2[e] if weight_first else g[i, j, k] * (rb(h) @ w2[e])
    return y

  y, _ = moe_dispatch.routed_experts(
      jnp.asarray(x, jnp.bfloat16), jnp.asarray(g), jnp.asarray(sel, jnp.int32),
      jnp.asarray(valid), *(jnp.asarray(w, jnp.float32) for w in (w1, w3, w2)), mode=mode,
      capacity_factor=E / K, swiglu_limit=LIMIT)
  want = ref(weight_first=True)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0, atol=1e-6)
  assert np.abs(ref(weight_first=False) - want).max() > 1e-3   # the orders are distinguishable


def _skewed_routing(rng, n, k, e, empty=(2, 5)):
  """Top-k ids per token from a skewed popularity with `empty` experts never chosen."""
  p = np.exp(1.2 * rng.standard_normal(e))
  p[list(empty)] = 0.0
  return np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(n)])


def _autodiff_dropless(x_NxD, weights_NxK, experts_NxK, valid_N, w1, w3, w2, limit,
                       narrow=False):
  """The dispatch with plain gathers (jax's scatter transposes) and separate gate / up products
  through `ragged_dot`: what the fused product and the gather VJPs must equal. `narrow`: each
  product's float32 result rounded once to x's dtype (`product_dtype="compute"`)."""
  n, k = experts_NxK.shape
  e = w1.shape[0]
  dt = x_NxD.dtype
  e_P = jnp.where(valid_N[None, :], experts_NxK.T, e).reshape(-1)
  order = jnp.argsort(e_P, stable=True)
  sizes = jnp.zeros((e + 1,), jnp.int32).at[e_P].add(1)[:e]
  xs = x_NxD[order % n]
  out = dt if narrow else jnp.float32
  mm = lambda a, w: jax.lax.ragged_dot(a, w.astype(dt), sizes,
                                       preferred_element_type=jnp.float32).astype(out)
  h = moe_dispatch.clamped_swiglu(mm(xs, w1), mm(xs, w3), limit)
  h = (h * weights_NxK.T.reshape(-1)[order][:, None]).astype(dt)
  y = jnp.where((e_P[order] < e)[:, None], mm(h, w2), 0.0)
  return jnp.zeros((n * k, x_NxD.shape[1]), jnp.float32).at[order].set(y).reshape(k, n, -1).sum(0)


def _skewed_case(seed, dtype, n=40, d=16, f=8, e=8, k=2):
  """Skewed routing (experts 2 and 5 empty), routing weights, ~10 % padding tokens, x in `dtype`,
  float32 expert weights scaled by their fan-in, and a cotangent r."""
  rng = np.random.default_rng(seed)
  experts = jnp.asarray(_skewed_routing(rng, n, k, e), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.2, 1.2, (n, k)), jnp.float32)
  valid = jnp.asarray(rng.uniform(size=n) > 0.1)
  x = jnp.asarray(rng.standard_normal((n, d)), dtype)
  ws = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
        for s in ((e, d, f), (e, d, f), (e, f, d))]
  r = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  return experts, weights, valid, x, ws, r


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dropless_equals_ragged_dot_under_skewed_routing(dtype):
  """Fused [w1 | w3] product and gather-only VJPs = separate ragged_dot products and jax's own
  scatter transposes, outputs and all gradients; two experts get no rows, padding tokens none."""
  experts, weights, valid, x, ws, r = _skewed_case(21, dtype)

  def fast(x, g, w1, w3, w2):
    y, _ = moe_dispatch.routed_experts(x[None], g[None], experts[None], valid[None], w1, w3, w2,
                                       mode="dropless", swiglu_limit=LIMIT, policy="reference")
    return y[0]

  def slow(x, g, w1, w3, w2):
    return _autodiff_dropless(x, g, experts, valid, w1, w3, w2, LIMIT)

  loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * r), argnums=range(5)))
  (v_fast, g_fast), (v_slow, g_slow) = loss(fast)(x, weights, *ws), loss(slow)(x, weights, *ws)
  np.testing.assert_allclose(np.asarray(fast(x, weights, *ws)), np.asarray(slow(x, weights, *ws)),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(float(v_fast), float(v_slow), rtol=1e-6)
  for name, a, b in zip(["x", "weights", "w1", "w3", "w2"], g_fast, g_slow):
    assert a.dtype == b.dtype, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # float32: the same products, gradients summed in another order; bf16 x: its gradient is
    # rounded to bf16 once either way, so the order can flip one rounding (an ulp).
    tol = 1e-5 if dtype == jnp.float32 or name != "x" else 2 ** -7
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
  empty = np.asarray(g_fast[2])[[2, 5]]
  assert np.all(empty == 0.0)   # the empty experts' weights get exactly no gradient


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_compute_dtype_products_equal_rounded_restatement(mode):
  """`product_dtype="compute"` in bf16: [a | u] and each pair's down-projection rounded once to
  bf16, then summed in float32. Equal to the plain-jax restatement with those roundings (values
  and every gradient) and measurably different from float32 products; an unknown product dtype is
  a clear error.

  Tolerance. The restatement's products are other GEMMs (separate gate and up `ragged_dot`s; for
  capacity, the buffer's einsums): where their float32 sums differ in the last bit next to a bf16
  rounding boundary, one rounding flips (one bf16 ulp of that a, u or pair output). On this
  machine none flips; on another CPU a few may. So: every value within a few bf16 ulps of the
  output's scale, and at least 90 % equal to float32 rounding, where float32 products leave almost
  none equal; every gradient within 2^-7 of its scale, and in dropless (the same products) at least
  90 % of each weight's gradient within 1e-5 of its scale."""
  experts, weights, valid, x, ws, r = _skewed_case(23, jnp.bfloat16)
  e, k = ws[0].shape[0], experts.shape[1]

  def routed(product_dtype):
    def fn(x, g, w1, w3, w2):
      y, _ = moe_dispatch.routed_experts(
          x[None], g[None], experts[None], valid[None], w1, w3, w2, mode=mode,
          capacity_factor=e / k, swiglu_limit=LIMIT, policy="reference",
          product_dtype=product_dtype)
      return y[0]
    return fn

  slow = lambda x, g, w1, w3, w2: _autodiff_dropless(x, g, experts, valid, w1, w3, w2, LIMIT,
                                                     narrow=True)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * r), argnums=range(5)))
  args = (x, weights, *ws)
  y, want, wide = (np.asarray(jax.jit(f)(*args)) for f in (routed("compute"), slow,
                                                             routed("float32")))
  scale = np.abs(want).max()
  equal = lambda got: np.mean(np.abs(got - want) <= 1e-6 * scale)
  assert np.abs(y - want).max() <= 2.0**-6 * scale
  assert equal(y) >= 0.9 and equal(wide) <= 0.5, (equal(y), equal(wide))
  (v_fast, g_fast), (v_slow, g_slow) = loss(routed("compute"))(*args), loss(slow)(*args)
  np.testing.assert_allclose(float(v_fast), float(v_slow), rtol=2.0**-7)
  for name, a, b in zip(["x", "weights", "w1", "w3", "w2"], g_fast, g_slow):
    assert a.dtype == b.dtype, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # Besides the flips above: capacity's routing-weight gradient is autodiff through a bf16
    # rounding of g·s that jit on the CPU may keep in float32 (XLA's excess precision), ~1e-3 of
    # its scale off the restatement with float32 products too.
    np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-7 * np.abs(b).max(), err_msg=name)
    if mode == "dropless" and name != "x":   # the same products: float32 rounding but for a flip
      assert np.mean(np.abs(a - b) <= 1e-5 * np.abs(b).max()) >= 0.9, name
  with pytest.raises(ValueError, match="product dtype"):
    routed("bfloat16")(*args)


def test_compute_dtype_products_match_float64_official_order():
  """Against the official V4 arithmetic restated in float64 (bf16 x and weights; a = w1 x and
  u = w3 x rounded to bf16, the weighted activation rounded to bf16, each expert's W2 output
  rounded to bf16, the pairs summed): within the one-bf16-ulp flips that float32 accumulation can
  cause at a rounding boundary, while float32 products are ~1e-2 away."""
  x, w1, w3, w2, sel, g, valid = _official_case(12)
  b, t = valid.shape
  y64 = np.zeros((b, t, D))
  for i, j, k in np.ndindex(b, t, K):
    if valid[i, j]:
      e = sel[i, j, k]
      a = np.minimum(rb(x[i, j] @ w1[e]), LIMIT)
      h = a / (1 + np.exp(-a)) * np.clip(rb(x[i, j] @ w3[e]), -LIMIT, LIMIT)
      y64[i, j] += rb(rb(g[i, j, k] * h) @ w2[e])
  got = {}
  for pd in ("compute", "float32"):
    y, _ = moe_dispatch.routed_experts(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(g), jnp.asarray(sel, jnp.int32),
        jnp.asarray(valid), *(jnp.asarray(w, jnp.float32) for w in (w1, w3, w2)),
        swiglu_limit=LIMIT, product_dtype=pd)
    got[pd] = np.asarray(y, np.float64)
  # a flip of one rounding moves a pair's output by at most ~2 bf16 ulps of its scale
  scale = np.abs(y64).max()
  err = np.abs(got["compute"] - y64)
  assert err.max() <= 2 * 2.0**-8 * scale, err.max() / scale
  assert np.mean(err <= 1e-6 * scale) > 0.9        # nearly every value equal to float rounding
  assert np.abs(got["float32"] - y64).max() > 4 * err.max()


def test_fused_gate_up_product_equals_two_products():
  rng = np.random.default_rng(22)
  rows, d, f, e = 48, 32, 16, 4
  sizes = jnp.asarray([20, 0, 17, 9], jnp.int32)          # 2 padding rows past the groups
  x = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
  w1, w3, w2 = (jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
                for s in ((e, d, f), (e, d, f), (e, f, d)))
  g = jnp.asarray(rng.uniform(0.2, 1.2, rows), jnp.float32)
  got = moe_dispatch.grouped_ffn(x, g, w1, w3, w2, sizes, LIMIT, "reference")
  mm = lambda a, w: moe_dispatch.grouped_matmul(a, w, sizes, "reference")
  h = (moe_dispatch.clamped_swiglu(mm(x, w1), mm(x, w3), LIMIT) * g[:, None]).astype(x.dtype)
  want = mm(h, w2)
  # Each column of the fused product is the same bf16 dot with float32 accumulation; only the
  # bf16 rounding of h could differ by an ulp, which W2 then spreads: well inside 2^-8 relative.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                             atol=2 ** -8 * float(jnp.abs(want).max()))
  assert float(jnp.abs(got[46:]).max()) == 0.0


def test_nan_input_gives_nan_output_not_finite_numbers():
  rng = np.random.default_rng(23)
  n, d, f, e, k = 12, 16, 8, 8, 2
  experts = jnp.asarray(_skewed_routing(rng, n, k, e), jnp.int32)
  x = np.asarray(rng.standard_normal((n, d)), np.float32)
  x[3, 5] = np.nan
  ws = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
  y, _ = moe_dispatch.routed_experts(jnp.asarray(x)[None], jnp.ones((1, n, k)), experts[None],
                                     jnp.ones((1, n), bool), *ws, mode="dropless",
                                     swiglu_limit=LIMIT)
  y = np.asarray(y[0])
  assert np.isnan(y[3]).any()
  assert np.isfinite(np.delete(y, 3, axis=0)).all()   # NaN stays with its token


def _dots(jaxpr):
  """Every dot_general of a jaxpr and of the jaxprs nested in its equations (scan, custom VJP)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _dots(inner)


def _within_bf16_ulp_of(got, want64):
  got = np.asarray(got, np.float64)
  ulp = np.exp2(np.floor(np.log2(np.abs(want64))) - 7)
  assert (np.abs(got - want64) <= ulp).all()
  return (np.abs(got - want64) > ulp / 2).mean()


def test_expert_einsum_forward_unchanged_backward_in_bf16_once_rounded():
  rng = np.random.default_rng(24)
  eq = "btd,df->btf"
  x = jnp.asarray(rng.standard_normal((3, 5, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 48)) / 8, jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((3, 5, 48)), jnp.float32)
  y, vjp = jax.vjp(lambda a, b: moe_dispatch.expert_einsum(eq, a, b), x, w)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(
      jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)))
  gx, gw = vjp(g)
  assert gx.dtype == gw.dtype == jnp.bfloat16
  # The cotangent rounded to bf16 once, both products accumulated in float32 and rounded once:
  # within one bf16 ulp of the float64 products of the rounded cotangent (half an ulp when the
  # rounding is exact; the float32 sums of 15 and 48 terms can move a value across a midpoint).
  G = np.asarray(g.astype(jnp.bfloat16), np.float64)
  X, W = np.asarray(x, np.float64), np.asarray(w, np.float64)
  assert _within_bf16_ulp_of(gx, G @ W.T) < 0.02
  assert _within_bf16_ulp_of(gw, np.einsum("btd,btf->df", X, G)) < 0.02
  # float32 operands: autodiff of the einsum, bit for bit.
  loss = lambda f: jax.grad(lambda a, b: jnp.sum(f(a, b) * g), argnums=(0, 1))  # noqa: E731
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  got = loss(lambda a, b: moe_dispatch.expert_einsum(eq, a, b))(x32, w32)
  want = loss(lambda a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32))(x32, w32)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_bf16_moe_backward_has_no_float32_by_bf16_product(mode):
  # The bf16 layer's gradient: every dot multiplies operands of one dtype (bf16 experts, the
  # float32 router); a float32 cotangent times a bf16 weight was the shared and capacity experts'
  # backward before expert_einsum (this test failed then). Dropless: the shared expert's dots (its
  # grouped products are the ragged_dot primitive here, the Mosaic kernel's VJP on the GPU).
  cfg = moe_cfg(moe_dispatch=mode, dtype="bfloat16", moe_capacity_factor=E / K)
  graphdef, params = nnx.split(MoE(cfg, nnx.Rngs(3)))
  x, seg, image, bias = moe_inputs(3)

  def loss(p, x):
    y, _ = nnx.merge(graphdef, p)(x, segment_ids_BxT=jnp.asarray(seg),
                                  image_mask_BxT=jnp.asarray(image), bias_2xE=jnp.asarray(bias))
    return jnp.sum(y.astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(x, jnp.bfloat16))
  dots = list(_dots(jaxpr.jaxpr))
  kinds = {tuple(str(v.aval.dtype) for v in e.invars) for e in dots}
  assert len(dots) >= 12 and ("bfloat16", "bfloat16") in kinds, kinds
  assert kinds <= {("bfloat16", "bfloat16"), ("float32", "float32")}, kinds



@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_layer_scan_hoists_no_row_sized_constant(mode):
  """Inside the model's layer scan JAX's partial evaluation hoists loop-invariant values out of
  the loop, and a `where(live, y, 0)` / `where(bad, NaN, y)` over the pairs' or tokens' rows made
  its broadcast zeros / NaN such a value: a float32 [rows, D] buffer made once and read by every
  layer (s3, 2026-12-02b: 256 MB of zeros at [65,536, 1024] and 64 MB of NaN a layer). The
  gradient of a 2-layer scan of the MoE layer under layer remat passes no constant of rows of D
  into the loop but the zero row that dropped pairs read (with those wheres, and the reference
  product's where(bad, NaN, y): float32 [pairs, D] and [tokens, D] ones in either mode)."""
  from dsv41_jax import model as M
  cfg = moe_cfg(dtype="bfloat16", moe_dispatch=mode, ops=dict(grouped_matmul="reference"))
  graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(4)))
  stacked = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), state)
  x, seg, image, bias = moe_inputs(4)

  def layer(x, p):
    y, _ = nnx.merge(graphdef, p)(x, segment_ids_BxT=seg, image_mask_BxT=image, bias_2xE=bias)
    return (x + y).astype(x.dtype), None

  step = jax.checkpoint(layer, prevent_cse=False, policy=M.remat_policy)
  loss = lambda x, p: jnp.sum(jax.lax.scan(step, x, p)[0].astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x, jnp.bfloat16),
                                                          stacked).jaxpr
  # the scan's loop-invariant inputs: `num_consts` on jax 0.10, the first part of `ft_in` on 0.11
  n_consts = lambda p: (p["num_consts"] if "num_consts" in p  # noqa: E731
                        else len(p["ft_in"].unpack()[0]))
  consts = [v.aval for eqn in jaxpr.eqns if eqn.primitive.name == "scan"
            for v in eqn.invars[:n_consts(eqn.params)]
            if v.aval.shape[-1:] == (D,) and v.aval.size > D]
  assert consts == [], consts


def _np_weighted_swiglu(au, g, dh, limit):
  """float64: h = g · SiLU(min(a, L)) · clip(u, ±L) for [a | u] = au, and the gradients of
  Σ dh·h: d[a | u] and dg (with Σ|dh·s| for dg's rounding bound). At a tie (a = L, |u| = L) the
  derivative is the mean of the one-sided ones, as jax's min and max have it."""
  au, g, dh = (np.asarray(v, np.float64) for v in (au, g, dh))
  f = au.shape[1] // 2
  a, u = au[:, :f], au[:, f:]
  ac, uc = np.minimum(a, limit), np.clip(u, -limit, limit)
  sig = 1 / (1 + np.exp(-ac))
  silu = ac * sig
  s = silu * uc
  mask_a = np.where(a < limit, 1.0, np.where(a == limit, 0.5, 0.0))
  mask_u = np.where(np.abs(u) < limit, 1.0, np.where(np.abs(u) == limit, 0.5, 0.0))
  ds = dh * g[:, None]
  da = ds * uc * sig * (1 + ac * (1 - sig)) * mask_a
  du = ds * silu * mask_u
  return g[:, None] * s, np.concatenate([da, du], axis=1), (dh * s).sum(1), np.abs(dh * s).sum(1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weighted_swiglu_against_float64_and_autodiff(dtype):
  """The custom VJP of g · clamped SwiGLU([a | u]): autodiff's values bit for bit (ties at the
  clamps included), the float64 function and gradients within float32 rounding, and g's gradient
  summed over the [P, 2, F] index space of d[a | u] (what lets XLA fuse the backward into one
  pass; a [P, F] sum is autodiff's second pass)."""
  rng = np.random.default_rng(31)
  p, f = 96, 64
  au = rng.standard_normal((p, 2 * f)) * 1.5
  au[:6, 3] = LIMIT               # ties at the clamps: the derivative's 1/2
  au[6:12, f + 2] = LIMIT
  au[12:18, f + 5] = -LIMIT
  au = jnp.asarray(au, jnp.float32)
  g = jnp.asarray(rng.uniform(0.1, 1.5, p), jnp.float32)
  dh = jnp.asarray(rng.standard_normal((p, f)), dtype)   # the cotangent comes in h's dtype
  fused = lambda a, w: moe_dispatch.weighted_swiglu(a, w, LIMIT, dtype)    # noqa: E731
  plain = lambda a, w: moe_dispatch._weighted_swiglu(a, w, LIMIT, dtype)   # noqa: E731
  h, vjp = jax.vjp(fused, au, g)
  h_ad, vjp_ad = jax.vjp(plain, au, g)
  got, want = (h, *vjp(dh)), (h_ad, *vjp_ad(dh))
  for name, a, b in zip(["h", "d_au", "d_g"], got, want):
    assert a.dtype == b.dtype, name
    np.testing.assert_array_equal(np.asarray(a, np.float32).view(np.int32),
                                  np.asarray(b, np.float32).view(np.int32), err_msg=name)

  H, DAU, DG, DG_ABS = _np_weighted_swiglu(au, g, dh, LIMIT)
  h, d_au, d_g = (np.asarray(v, np.float64) for v in got)
  if dtype == jnp.bfloat16:
    assert _within_bf16_ulp_of(h, H) < 0.02    # rounded to bf16 once
  else:
    np.testing.assert_allclose(h, H, rtol=2e-6, atol=0)
  # a few float32 roundings and exp's per element; near SiLU's stationary point the factor
  # 1 + a(1 - σ(a)) cancels, hence the small absolute part
  np.testing.assert_allclose(d_au, DAU, rtol=2e-6, atol=2e-7 * np.abs(DAU).max())
  assert np.all(np.abs(d_g - DG) <= 2e-6 * np.abs(DG) + f * 2.0**-24 * DG_ABS)
  sums = testing.jaxpr_eqns(jax.make_jaxpr(vjp)(dh), "reduce_sum")
  assert [e.invars[0].aval.shape for e in sums if e.invars[0].aval.size > p] == [(p, 2, f)]


def _moe_scan_loss(cfg, seed, policy):
  """Loss of a 2-layer scan of the MoE layer under layer remat with `policy`, its parameters
  stacked, and the inputs: (loss(params, x), params, x in the config's dtype)."""
  graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(seed)))
  stacked = jax.tree.map(lambda a: jnp.stack([a, -0.7 * a]), state)
  x, seg, image, bias = moe_inputs(seed)

  def layer(x, p):
    y, aux = nnx.merge(graphdef, p)(x, segment_ids_BxT=seg, image_mask_BxT=image, bias_2xE=bias)
    return (x + y).astype(x.dtype), aux["balance_loss"]

  step = jax.checkpoint(layer, prevent_cse=False, policy=policy)

  def loss(p, x):
    out, balance = jax.lax.scan(step, x, p)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))) + balance.sum()
  return loss, stacked, jnp.asarray(x, cfg.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_gradients_under_remat_equal_autodiff_bit_for_bit(dtype, monkeypatch):
  """The MoE layer (router, dropless routed experts, shared expert) in a layer scan under the
  model's remat policy: the loss and the gradients of x and of every parameter are those of
  autodiff through the SwiGLU, bit for bit. (Without layer remat, jax 0.10.2's CPU backend gives
  float32 compute one to two float32 ulps apart: the custom backward recomputes the sigmoid that
  autodiff's forward stored, in another fusion; jax 0.11.2 is bitwise there too.)"""
  from dsv41_jax import model as M
  cfg = moe_cfg(dtype=dtype, n_shared_experts=1, ops=dict(grouped_matmul="reference"))

  def run():
    loss, params, x = _moe_scan_loss(cfg, 7, M.remat_policy)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

  fused = run()
  monkeypatch.setattr(moe_dispatch, "weighted_swiglu", moe_dispatch._weighted_swiglu)
  plain = run()
  leaves = jax.tree.leaves(fused)
  assert len(leaves) == 1 + 7 + 1   # the loss, 7 parameters (router, routed and shared w1, w3, w2), x
  for a, b in zip(leaves, jax.tree.leaves(plain)):
    a, b = np.atleast_1d(np.asarray(a, np.float32)), np.atleast_1d(np.asarray(b, np.float32))
    np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))


def test_moe_layer_takes_the_product_dtype_from_its_config():
  """`ModelConfig.moe_product_dtype` reaches the dispatch: in a bf16 model "compute" changes the
  layer's output (the products rounded); in a float32 model it is the float32 path bit for bit."""
  x, seg, image, bias = moe_inputs(7)
  out = {}
  for dtype in ("float32", "bfloat16"):
    for pd in ("float32", "compute"):
      model = MoE(moe_cfg(dtype=dtype, moe_product_dtype=pd), nnx.Rngs(3))
      y, _ = call_moe(model, jnp.asarray(x, dtype), seg, image, bias)
      out[dtype, pd] = np.asarray(y, np.float32)
  np.testing.assert_array_equal(out["float32", "compute"], out["float32", "float32"])
  assert np.abs(out["bfloat16", "compute"] - out["bfloat16", "float32"]).max() > 0
  with pytest.raises(ValueError, match="moe_product_dtype"):
    moe_cfg(moe_product_dtype="bfloat16")


@pytest.mark.parametrize("mesh_shape", [{"data": 2, "expert": 4},
                                        {"fsdp": 2, "expert": 2, "tensor": 2}])
def test_compute_dtype_products_sharded_equal_single_device(mesh_shape):
  """bf16 model, `moe_product_dtype="compute"`, dropless across the mesh (all-to-all to the
  experts' owners; with `tensor` the down-projection's partials rounded after their psum): values
  and gradients as on one device, within the bf16 roundings that the sharded sums reorder (bound
  below; a lost exchange or partial sum is off by O(1), and removing the tensor psum fails this)."""
  cfg = moe_cfg(dtype="bfloat16", moe_product_dtype="compute")
  model = MoE(cfg, nnx.Rngs(6))
  x, seg, image, bias = moe_inputs(8, b=8, t=4)
  x = jnp.asarray(x, jnp.bfloat16)
  r = np.random.default_rng(9).normal(size=x.shape).astype(np.float32)
  graphdef, state = nnx.split(model)

  def loss(state, x, seg, image, bias, r):
    y, aux = nnx.merge(graphdef, state)(x, segment_ids_BxT=seg, image_mask_BxT=image,
                                        bias_2xE=bias)
    return (y.astype(jnp.float32) * r).sum() + aux["balance_loss"], (y, aux)

  # The output: each pair's down-projection rounded to bf16 (the expert's GEMM may block its rows
  # otherwise on another device), the sum rounded once more: a flip of each, 2^-6 of its scale.
  # Gradients
  # are sums of bf16-rounded partials: x's of the K pairs', the shared expert's and the router's
  # cotangents, each a psum of bf16 halves under `tensor`; a weight's over the batch shards, each
  # shard's sum rounded before the psum. Up to 8 roundings of ~½ ulp each: 2^-5 of the leaf's
  # scale, which one XLA version needs and another does not (jax 0.11.2 put the shared expert's w2
  # gradient 4 ulps off; 0.10.2 within 1), with float32 products as much as with "compute" ones.
  ulps = lambda path: 2.0**-5 if path.startswith("['grads']") else 2.0**-6
  scale = lambda path, single: ulps(path) * float(np.abs(np.asarray(single, np.float32)).max())
  result = testing.assert_sharded_matches(
      _with_grads(loss), (state, x, seg, image, bias, r), testing.cpu_mesh(mesh_shape),
      in_specs=("params", "batch", "batch", "batch", None, "batch"),
      rtol=lambda path, _: 1e-6 if path.startswith("['aux']") else 0.0,
      atol=lambda path, single: 0.0 if path.startswith("['aux']") else scale(path, single))
  flat = jax.tree.leaves(result.single["grads"])
  assert all(np.abs(np.asarray(g, np.float32)).max() > 0 for g in flat)


@pytest.mark.parametrize("mode,mesh_shape", [
    ("dropless", None), ("capacity", None),
    ("dropless", {"fsdp": 2, "expert": 2, "tensor": 2}),   # the MLP width split over tensor
    ("capacity", {"data": 2, "expert": 2, "tensor": 2}),
])
def test_gate_up_pair_gives_the_same_experts_bit_for_bit(mode, mesh_shape):
  """`gate_up_pair` (w1 and w3 as one [E, D, 2, F] array, how `launch.step.cast_once` hands the
  routed experts to the model): the same output and the same gradients (x, w1, w3, w2) as the two
  weights, on one device and with the MLP width split over `tensor`, where a [E, D, 2F]
  concatenation split along its last axis would pair one device's gate with another's up."""
  rng = np.random.default_rng(31)
  b, t = 8, 4
  x = jnp.asarray(rng.normal(size=(b, t, D)) * 1.5, jnp.bfloat16)
  w1, w3 = (jnp.asarray(rng.normal(size=(E, D, F)) / 4, jnp.bfloat16) for _ in range(2))
  w2 = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.bfloat16)
  experts = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(b * t)]).reshape(b, t, K))
  weights = jnp.asarray(rng.uniform(0.2, 1.3, size=(b, t, K)), jnp.float32)
  valid = jnp.asarray(rng.uniform(size=(b, t)) > 0.1)
  r = jnp.asarray(rng.normal(size=(b, t, D)), jnp.float32)

  def loss(x, w1, w3, w2, paired):
    a, c = moe_dispatch.gate_up_pair(w1, w3) if paired else (w1, w3)
    y, dropped = moe_dispatch.routed_experts(x, weights, experts, valid, a, c, w2, mode=mode,
                                             capacity_factor=0.75, swiglu_limit=LIMIT)
    return (y.astype(jnp.float32) * r).sum(), (y, dropped)

  def run(paired):
    f = jax.jit(jax.value_and_grad(lambda *a: loss(*a, paired), argnums=(0, 1, 2, 3),
                                   has_aux=True))
    if mesh_shape is None:
      return f(x, w1, w3, w2)
    with jax.set_mesh(testing.cpu_mesh(mesh_shape)):
      return f(x, w1, w3, w2)

  (l0, (y0, d0)), g0 = run(False)
  (l1, (y1, d1)), g1 = run(True)
  assert float(jnp.abs(g0[1]).max()) > 0 and float(jnp.abs(g0[2]).max()) > 0
  for a, b_ in zip((l0, y0, d0, *g0), (l1, y1, d1, *g1)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))
  pair, empty = moe_dispatch.gate_up_pair(w1, w3)
  assert pair.shape == (E, D, 2, F) and empty.shape == (E, D, 0)
