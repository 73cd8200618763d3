"""DeepSeekMoE (dsv41_jax/layers/moe.py): routing, load and balance loss against float64 numpy
loops; the float64 references that test_moe_dispatch.py and test_block.py share. The dispatch
itself (dropless, capacity, expert-parallel) is tested in test_moe_dispatch.py."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import testing
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.moe import MoE, document_totals, route, sequence_balance_loss

D, E, K, F = 16, 8, 2, 8
LIMIT = 1.5  # small enough that the clamps of §8.2 bite on unit-scale inputs


def moe_cfg(**kw):
  base = dict(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
              swiglu_limit=LIMIT, routed_scaling_factor=1.5, gate_temp=0.8, dtype="float32")
  base.update(kw)
  return ModelConfig(**base)


def moe_inputs(seed, b=4, t=8):
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

def np_route(x, router, bias_2xE, image, k, scale, temp):
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


def np_expert(x, w1, w3, w2, limit):
  a = np.minimum(x @ w1, limit)
  u = np.clip(x @ w3, -limit, limit)
  return (a / (1 + np.exp(-a)) * u) @ w2


def np_moe(params, x, w, sel, valid, limit, dropped=None):
  """Dense per-token loop; pairs marked in `dropped` are left out."""
  x = x.astype(np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  b, t, _ = x.shape
  y = np.zeros_like(x)
  for i in range(b):
    for j in range(t):
      if "shared_w1" in p:
        y[i, j] += np_expert(x[i, j], p["shared_w1"], p["shared_w3"], p["shared_w2"], limit)
      if not valid[i, j]:
        continue
      for kk in range(sel.shape[-1]):
        if dropped is not None and dropped[i, j, kk]:
          continue
        e = sel[i, j, kk]
        y[i, j] += w[i, j, kk] * np_expert(x[i, j], p["w1"][e], p["w3"][e], p["w2"][e], limit)
  return y


def _np_documents(seg):
  """(row, first, end) of each document: a run of equal non-zero segment ids in a row."""
  for i in range(seg.shape[0]):
    j = 0
    while j < seg.shape[1]:
      end = j
      while end < seg.shape[1] and seg[i, end] == seg[i, j]:
        end += 1
      if seg[i, j] != 0:
        yield i, j, end
      j = end


def _np_expert_share(sel, i, j, end):
  """f of §8.4 for tokens j..end of row i: E / (K·T_doc) per selection."""
  f = np.zeros(E)
  for tt in range(j, end):
    for e in sel[i, tt]:
      f[e] += E / (K * (end - j))
  return f


def _np_balance(s, sel, seg):
  """docs/design.md §8.4 per document (runs of equal non-zero segment id), averaged over documents."""
  losses = []
  for i, j, end in _np_documents(seg):
    prob = (s[i, j:end] / s[i, j:end].sum(-1, keepdims=True)).mean(0)
    losses.append((_np_expert_share(sel, i, j, end) * prob).sum())
  return np.mean(losses)


def moe_params(model):
  p = dict(router=model.router[...], w1=model.experts.w1[...], w3=model.experts.w3[...],
           w2=model.experts.w2[...])
  if model.shared is not None:
    p.update(shared_w1=model.shared.w1[...], shared_w3=model.shared.w3[...],
             shared_w2=model.shared.w2[...])
  return {k: np.asarray(v) for k, v in p.items()}


@nnx.jit
def call_moe(model, x, seg, image, bias):
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
    ref_w, ref_e, _ = np_route(logits, np.eye(E), np.stack([np.broadcast_to(b, E)] * 2),
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


def test_padding_load_and_balance_loss():
  cfg = moe_cfg()
  model = MoE(cfg, nnx.Rngs(3))
  x, seg, image, bias = moe_inputs(3)
  _, aux = call_moe(model, x, seg, image, bias)
  p = moe_params(model)
  _, sel, s = np_route(x, p["router"], bias, image, K, cfg.routed_scaling_factor, cfg.gate_temp)
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
  y2, aux2 = call_moe(model, x2, seg, image, bias)
  np.testing.assert_array_equal(np.asarray(aux2["load_2xE"]), load)
  assert float(aux2["balance_loss"]) == float(aux["balance_loss"])
  shared_only = np_moe(p, x2, np.zeros((*seg.shape, K)), sel, np.zeros_like(valid), LIMIT)
  np.testing.assert_allclose(np.asarray(y2)[~valid], shared_only[~valid], rtol=1e-5, atol=2e-6)


def _random_segments(rng, b, t):
  """Rows of random runs: documents of 1-7 tokens, some padding runs (id 0), some neighbours
  sharing an id (one document, as the loss reads them)."""
  seg = np.zeros((b, t), np.int32)
  for i in range(b):
    j, doc = 0, 0
    while j < t:
      n = int(rng.integers(1, 8))
      doc = 0 if rng.random() < 0.2 else (doc if rng.random() < 0.1 else doc + 1)
      seg[i, j:j + n] = doc
      j += n
  return seg


def _np_balance_grad(s, sel, seg):
  """d(balance loss)/d(scores) in float64 by the chain rule of §8.4: through P only (f has no
  gradient), then through the row normalisation ŝ = s / Σ s."""
  g = np.zeros_like(s, np.float64)
  docs = list(_np_documents(seg))
  for i, j, end in docs:
    dnorm = _np_expert_share(sel, i, j, end) / (end - j)       # dL_doc / dŝ_{t,i}
    for tt in range(j, end):
      row = s[i, tt].astype(np.float64)
      g[i, tt] = (dnorm - (dnorm * row).sum() / row.sum()) / row.sum()
  return g / max(len(docs), 1)


def test_document_totals_equal_a_loop_over_runs():
  rng = np.random.default_rng(11)
  seg = _random_segments(rng, 5, 40)
  v = rng.integers(0, 3, size=(5, 40, 4)).astype(np.float32)
  want = np.zeros_like(v)
  for i in range(5):
    for t in range(40):
      a = t
      while a > 0 and seg[i, a - 1] == seg[i, t]:
        a -= 1
      z = t
      while z < 39 and seg[i, z + 1] == seg[i, t]:
        z += 1
      want[i, t] = v[i, a:z + 1].sum(0)
  np.testing.assert_array_equal(np.asarray(jax.jit(document_totals)(v, seg)), want)


def test_balance_loss_and_its_gradient_equal_float64_per_document_sums():
  """Random runs (padding runs, one-token documents, neighbours sharing an id): the loss equals the
  per-document loop and its gradient the float64 chain rule; the program has no scatter."""
  rng = np.random.default_rng(12)
  b, t = 3, 64
  seg = _random_segments(rng, b, t)
  s = (rng.random((b, t, E)) + 0.05).astype(np.float32)
  sel = np.argsort(rng.random((b, t, E)), -1)[..., :K].astype(np.int32)
  f = jax.jit(jax.value_and_grad(sequence_balance_loss))
  loss, grad = f(jnp.asarray(s), jnp.asarray(sel), jnp.asarray(seg))
  np.testing.assert_allclose(float(loss), _np_balance(s, sel, seg), rtol=2e-6)
  np.testing.assert_allclose(np.asarray(grad), _np_balance_grad(s, sel, seg), rtol=2e-5,
                             atol=1e-7 * np.abs(_np_balance_grad(s, sel, seg)).max())
  text = f.lower(jnp.asarray(s), jnp.asarray(sel), jnp.asarray(seg)).as_text()
  assert "scatter" not in text
  # all padding: no document, loss 0 and no gradient
  loss0, grad0 = f(jnp.asarray(s), jnp.asarray(sel), jnp.zeros((b, t), jnp.int32))
  assert float(loss0) == 0.0 and not np.asarray(grad0).any()


def _count(jaxpr, name: str, param: str = "") -> int:
  """Equations of primitive `name` whose params mention `param` (nested jaxprs included)."""
  return len(testing.jaxpr_eqns(jaxpr, name, lambda e: param in str(e.params)))


def test_layer_remat_keeps_the_logits_sort_and_output():
  """Under the model's remat policy (the router logits, the dispatch's pair sort and the layer's
  output named `moe_dispatch.KEPT`) the layer's gradient program sorts the pairs once, does not
  run the float32 router product again, and of the expert products recomputes only the gate/up
  ones, whose outputs the SwiGLU backward reads, not the routed down-projection. Without the
  name: 2 sorts, 8 grouped products and 4 router products."""
  from dsv41_jax import model as M
  cfg = moe_cfg(n_shared_experts=1, dtype="bfloat16", ops=dict(grouped_matmul="reference"))
  graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0)))
  x, seg, image, bias = moe_inputs(0)

  def loss(p, x):
    y, aux = nnx.merge(graphdef, p)(x, segment_ids_BxT=seg, image_mask_BxT=image, bias_2xE=bias)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))) + aux["balance_loss"]

  def counts(f):
    # The process-wide default precision is pinned for the trace: the vision tests set it to
    # "highest" at import, which would name every product HIGHEST in a shared test process.
    with jax.default_matmul_precision("default"):
      g = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(state, jnp.asarray(x, jnp.bfloat16)).jaxpr
    return (_count(g, "sort"), _count(g, "ragged_dot_general"),
            _count(g, "dot_general", "HIGHEST"))   # the router's float32 product

  # forward: gate/up and down; backward: dx, dw of each; the router's forward, dx, dw
  assert counts(loss) == (1, 6, 3)
  remat = jax.checkpoint(loss, prevent_cse=False, policy=M.remat_policy)
  assert counts(remat) == (1, 7, 3)      # + the gate/up product only


def test_router_precision_bf16_6x_runs_every_router_product_so():
  """`router_precision="bf16_6x"`: the router's product and both its transposes carry XLA's
  BF16_BF16_F32_X6 algorithm (the GPU runs them on tensor cores), and on the CPU, which computes
  that algorithm in float32, the layer's outputs and gradients equal HIGHEST's bit for bit."""
  x, seg, image, bias = moe_inputs(5)
  xb = jnp.asarray(x, jnp.bfloat16)
  grads, algorithms = {}, {}
  for prec in ("highest", "bf16_6x"):
    cfg = moe_cfg(router_precision=prec, dtype="bfloat16", n_shared_experts=1)
    graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0)))

    def loss(p, x):
      y, aux = nnx.merge(graphdef, p)(x, segment_ids_BxT=seg, image_mask_BxT=image, bias_2xE=bias)
      return jnp.sum(jnp.sin(y.astype(jnp.float32))) + aux["balance_loss"]
    grads[prec] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, xb)
    with jax.default_matmul_precision("default"):
      jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, xb).jaxpr
    algorithms[prec] = [str(e.params["precision"]) for e in testing.jaxpr_eqns(
        jaxpr, "dot_general", lambda e: "HIGHEST" in str(e.params) or "X6" in str(e.params))]
  assert algorithms == {"highest": ["(Precision.HIGHEST, Precision.HIGHEST)"] * 3,
                        "bf16_6x": ["BF16_BF16_F32_X6"] * 3}
  for a, b in zip(jax.tree.leaves(grads["highest"]), jax.tree.leaves(grads["bf16_6x"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
