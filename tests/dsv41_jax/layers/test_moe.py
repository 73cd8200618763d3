"""DeepSeekMoE (dsv41_jax/layers/moe.py, moe_dispatch.py) against float64 numpy loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import testing
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import moe_dispatch
from dsv41_jax.layers.moe import MoE, route

D, E, K, F = 16, 8, 2, 8
LIMIT = 1.5  # small enough that the clamps of §8.2 bite on unit-scale inputs


def _cfg(**kw):
  base = dict(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
              swiglu_limit=LIMIT, routed_scaling_factor=1.5, gate_temp=0.8, dtype="float32")
  base.update(kw)
  return ModelConfig(**base)


def _inputs(seed, b=4, t=8):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(b, t, D)).astype(np.float32) * 1.5
  seg = np.ones((b, t), np.int32)
  seg[0, 3:] = 2               # two documents in row 0
  seg[1, 5:] = 0               # trailing padding
  seg[2, :2] = 0               # leading padding
  seg[2, 6:] = 3
  image = rng.random((b, t)) < 0.3
  bias = rng.normal(size=(2, E)).astype(np.float32) * 0.3
  return x, seg, image, bias


# --- float64 references --------------------------------------------------------------------------

def _np_route(x, router, bias_2xE, image, k, scale, temp):
  logits = np.einsum("btd,de->bte", x.astype(np.float64), router.astype(np.float64)) / temp
  s = np.sqrt(np.log1p(np.exp(logits)))
  b = np.where(image[..., None], bias_2xE[1], bias_2xE[0]).astype(np.float64)
  biased = s + b
  order = np.argsort(-biased, axis=-1, kind="stable")
  sel = order[..., :k]
  # the selection must be well separated for float32 and float64 to agree
  srt = np.take_along_axis(biased, order, -1)
  assert np.min(srt[..., k - 1] - srt[..., k]) > 1e-4
  chosen = np.take_along_axis(s, sel, -1)
  w = chosen / (chosen.sum(-1, keepdims=True) + 1e-20) * scale
  return w, sel, s


def _np_expert(x, w1, w3, w2, limit):
  a = np.minimum(x @ w1, limit)
  u = np.clip(x @ w3, -limit, limit)
  return (a / (1 + np.exp(-a)) * u) @ w2


def _np_moe(params, x, w, sel, valid, limit, dropped=None):
  """Dense per-token loop; pairs marked in `dropped` are left out."""
  x = x.astype(np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  b, t, _ = x.shape
  y = np.zeros_like(x)
  for i in range(b):
    for j in range(t):
      if "shared_w1" in p:
        y[i, j] += _np_expert(x[i, j], p["shared_w1"], p["shared_w3"], p["shared_w2"], limit)
      if not valid[i, j]:
        continue
      for kk in range(sel.shape[-1]):
        if dropped is not None and dropped[i, j, kk]:
          continue
        e = sel[i, j, kk]
        y[i, j] += w[i, j, kk] * _np_expert(x[i, j], p["w1"][e], p["w3"][e], p["w2"][e], limit)
  return y


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


def _np_balance(s, sel, seg):
  """docs/design.md §8.4 per document (runs of equal non-zero segment id), averaged over documents."""
  losses = []
  for i in range(seg.shape[0]):
    j = 0
    while j < seg.shape[1]:
      end = j
      while end < seg.shape[1] and seg[i, end] == seg[i, j]:
        end += 1
      if seg[i, j] != 0:
        n = end - j
        f = np.zeros(E)
        for tt in range(j, end):
          for e in sel[i, tt]:
            f[e] += E / (K * n)
        prob = (s[i, j:end] / s[i, j:end].sum(-1, keepdims=True)).mean(0)
        losses.append((f * prob).sum())
      j = end
  return np.mean(losses)


def _params(model):
  p = dict(router=model.router[...], w1=model.experts.w1[...], w3=model.experts.w3[...],
           w2=model.experts.w2[...])
  if model.shared is not None:
    p.update(shared_w1=model.shared.w1[...], shared_w3=model.shared.w3[...],
             shared_w2=model.shared.w2[...])
  return {k: np.asarray(v) for k, v in p.items()}


@nnx.jit
def _call(model, x, seg, image, bias):
  return model(x, segment_ids_BxT=seg, image_mask_BxT=image, bias_2xE=bias)


# --- tests ---------------------------------------------------------------------------------------

def test_bias_changes_selection_not_weights():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 16, E)).astype(np.float32)
  bias = np.zeros(E, np.float32)
  bias[[1, 5]] = 2.0  # pushes experts 1 and 5 into most selections
  w0, e0, s0 = route(jnp.asarray(logits), jnp.zeros(E), K, 1.5, 0.8)
  w1, e1, s1 = route(jnp.asarray(logits), jnp.asarray(bias), K, 1.5, 0.8)
  np.testing.assert_array_equal(s0, s1)
  changed = np.any(np.sort(np.asarray(e0), -1) != np.sort(np.asarray(e1), -1), -1)
  assert changed.mean() > 0.5
  for w, e, b in ((w0, e0, 0.0), (w1, e1, bias)):
    ref_w, ref_e, _ = _np_route(logits, np.eye(E), np.stack([np.broadcast_to(b, E)] * 2),
                                np.zeros(logits.shape[:2], bool), K, 1.5, 0.8)
    np.testing.assert_array_equal(np.asarray(e), ref_e)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=2e-6)
  # where the selected sets agree the weights agree exactly: the bias never enters them
  same = ~changed
  np.testing.assert_array_equal(np.sort(np.asarray(w0), -1)[same], np.sort(np.asarray(w1), -1)[same])
  # weights of the selected experts sum to the route scale; the bias has no gradient
  np.testing.assert_allclose(np.asarray(w1).sum(-1), 1.5, rtol=1e-6)
  g = jax.grad(lambda b: route(jnp.asarray(logits), b, K, 1.5, 0.8)[0].sum())(jnp.asarray(bias))
  np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_dispatch_equals_dense_loop(mode):
  # capacity_factor E/K makes C = n: the worst case, so nothing may drop
  cfg = _cfg(moe_dispatch=mode, moe_capacity_factor=E / K)
  model = MoE(cfg, nnx.Rngs(1))
  x, seg, image, bias = _inputs(1)
  y, aux = _call(model, x, seg, image, bias)
  p = _params(model)
  w, sel, _ = _np_route(x, p["router"], bias, image, K, cfg.routed_scaling_factor, cfg.gate_temp)
  ref = _np_moe(p, x, w, sel, seg != 0, LIMIT)
  # the clamps are exercised
  assert np.mean(np.abs(x.reshape(-1, D) @ p["w1"][0]) > LIMIT) > 0.05
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=2e-6)
  assert float(aux["dropped_fraction"]) == 0.0


def test_capacity_drops_exactly_the_numpy_rule():
  cfg = _cfg(moe_dispatch="capacity", moe_capacity_factor=0.75, n_shared_experts=0)
  model = MoE(cfg, nnx.Rngs(2))
  x, seg, image, bias = _inputs(2)
  bias[0] += np.array([1.0, 0.6, 0, 0, 0, 0, 0, 0], np.float32)  # unbalanced text load
  p = _params(model)
  w, sel, _ = _np_route(x, p["router"], bias, image, K, cfg.routed_scaling_factor, cfg.gate_temp)
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
  np.testing.assert_allclose(np.asarray(y_r), _np_moe(p, x, w, sel, valid, LIMIT, want),
                             rtol=1e-5, atol=2e-6)

  y, aux = _call(model, x, seg, image, bias)
  np.testing.assert_allclose(np.asarray(y), _np_moe(p, x, w, sel, valid, LIMIT, want),
                             rtol=1e-5, atol=2e-6)
  assert float(aux["dropped_fraction"]) == pytest.approx(want.sum() / (valid.sum() * K), rel=1e-6)


def test_padding_load_and_balance_loss():
  cfg = _cfg()
  model = MoE(cfg, nnx.Rngs(3))
  x, seg, image, bias = _inputs(3)
  _, aux = _call(model, x, seg, image, bias)
  p = _params(model)
  _, sel, s = _np_route(x, p["router"], bias, image, K, cfg.routed_scaling_factor, cfg.gate_temp)
  valid = seg != 0
  load = np.zeros((2, E))
  for (i, j), v in np.ndenumerate(valid):
    if v:
      for e in sel[i, j]:
        load[int(image[i, j]), e] += 1
  np.testing.assert_array_equal(np.asarray(aux["load_2xE"]), load)
  assert aux["load_2xE"].dtype == jnp.float32
  np.testing.assert_allclose(float(aux["balance_loss"]), _np_balance(s, sel, seg), rtol=2e-6)

  # padding tokens: new values change neither load nor loss, and get no routed output
  x2 = x.copy()
  x2[~valid] = np.random.default_rng(9).normal(size=(int((~valid).sum()), D)) * 3
  y2, aux2 = _call(model, x2, seg, image, bias)
  np.testing.assert_array_equal(np.asarray(aux2["load_2xE"]), load)
  assert float(aux2["balance_loss"]) == float(aux["balance_loss"])
  shared_only = _np_moe(p, x2, np.zeros((*seg.shape, K)), sel, np.zeros_like(valid), LIMIT)
  np.testing.assert_allclose(np.asarray(y2)[~valid], shared_only[~valid], rtol=1e-5, atol=2e-6)


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
  cfg = _cfg(moe_dispatch=mode, moe_capacity_factor=cf)
  model = MoE(cfg, nnx.Rngs(4))
  x, seg, image, bias = _inputs(4, b=8, t=4)
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


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_routing_weight_scales_the_activation_before_w2_in_bf16(mode):
  """The official V4 order, W2 (g · SiLU(a) ⊙ u) with the weighted activation rounded to bf16,
  restated in float64; weighting W2's output instead differs by ~1e-2 here."""
  bf16 = jnp.bfloat16.dtype
  rb = lambda a: np.asarray(a, np.float64).astype(bf16).astype(np.float64)   # round to bf16
  rng = np.random.default_rng(11)
  b, t = 4, 8
  x = rb(rng.normal(size=(b, t, D)) * 1.5)
  w1, w3 = (rb(rng.normal(size=(E, D, F)) / 4) for _ in range(2))
  w2 = rb(rng.normal(size=(E, F, D)) / np.sqrt(F))
  sel = np.stack([rng.permutation(E)[:K] for _ in range(b * t)]).reshape(b, t, K)
  g = rng.uniform(0.2, 1.3, size=(b, t, K)).astype(np.float32)
  valid = np.ones((b, t), bool)
  valid[1, 5:] = False

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
