"""Whole-stack properties of `dsv41_jax.model` on a micro config with every CSA2 mode."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import model as M, testing
from dsv41_jax.errors import ConfigError
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.loss import objective
from dsv41_jax.engram import lookup as engram_lookup
from dsv41_jax.layers import engram as engram_layer, mhc as mhc_layer
from pallas_kernels.ops import mhc as ops_mhc, norm as ops_norm


@pytest.fixture(scope="module")
def cfg():
  return testing.tiny_config()


@pytest.fixture(scope="module")
def split_model(cfg):
  # The eager init: in a fresh process it costs ~21 s against ~8 s for init_model's jitted
  # program, but its per-op compiles are shared with every eager call before and after it in the
  # process, so in the suite's workers it costs ~1 s and the jitted program ~8-12 s (2026-12-02).
  graphdef, state = nnx.split(M.Transformer(cfg, nnx.Rngs(0)))
  return graphdef, state


def test_micro_config_covers_the_plan(cfg):
  plan = build_layer_plan(cfg)
  assert {l.mode for l in plan} == {"swa", "full", "reuse", "reindex"}
  assert any(r.n_layers > 1 and len(r.kinds) > 1 for r in plan.runs)  # scan + kind switch run


def test_causality_across_groups_and_documents(cfg, split_model):
  graphdef, state = split_model
  bias = M.zero_moe_bias(cfg)

  @jax.jit
  def logits_of(batch):
    return nnx.merge(graphdef, state)(batch, bias)[0]

  rng = np.random.default_rng(1)
  batch = testing.packed_batch(cfg, rng, boundaries=((13,), ()), pad_from=(None, 27))
  tokens, seg = batch["tokens"], batch["segment_ids"]
  base = np.asarray(logits_of(batch))
  assert np.isfinite(base).all()

  # 1. Changing tokens after t (t = 20 sits inside an m = 2 group) leaves logits at ≤ t unchanged.
  t = 20
  later = tokens.copy()
  later[:, t + 1:] = rng.integers(0, cfg.vocab_size, later[:, t + 1:].shape)
  out = np.asarray(logits_of(testing.make_batch(cfg, later, seg)))
  np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-5)
  assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max() > 1e-3

  # 2. Changing the first document of row 0 (tokens 0..12) leaves the second document unchanged.
  first = tokens.copy()
  first[0, :13] = rng.integers(0, cfg.vocab_size, 13)
  out = np.asarray(logits_of(testing.make_batch(cfg, first, seg)))
  np.testing.assert_allclose(out[0, 13:], base[0, 13:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[1], base[1], rtol=1e-5, atol=1e-5)
  assert np.abs(out[0, :13] - base[0, :13]).max() > 1e-3


def test_scan_equals_unrolled_and_prefill_stops_at_the_encoder(cfg, split_model):
  graphdef, state = split_model
  bias = M.zero_moe_bias(cfg)
  batch = testing.packed_batch(cfg, 3)
  unrolled = cfg.replace(scan_layers=False)
  g2, _ = nnx.split(nnx.eval_shape(lambda: M.Transformer(unrolled, nnx.Rngs(0))))

  @jax.jit
  def both(params):
    a = nnx.merge(graphdef, params)(batch, bias)[0]
    b = nnx.merge(g2, params)(batch, bias)[0]
    pre, _ = nnx.merge(graphdef, params)(batch, bias, stop_after_encoder=True)
    return a, b, pre

  a, b, pre = both(state)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  n_enc = cfg.num_hidden_layers // 2
  assert set(pre["decoder_kv"]) == {n_enc}
  kv = pre["decoder_kv"][n_enc]
  assert kv.main_kv_BxNxD.shape == (2, cfg.seq_len, cfg.head_dim)   # m = 1 in the decoder
  assert pre["encoder_state"].X_BxTxNxD.shape == (2, cfg.seq_len, cfg.hc_mult, cfg.hidden_size)


def _flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


class _Float64Math:
  """`jax.numpy` whose `float32` is float64."""

  def __getattr__(self, name):
    return jnp.float64 if name == "float32" else getattr(jnp, name)


def _in_float64(fn):
  """`fn` traced with the mHC ops, the RMS norm and the Engram layer (`pallas_kernels.ops.mhc`,
  `.norm`, `dsv41_jax.engram.lookup`, `dsv41_jax.layers.engram`), which compute in float32
  whatever their inputs' dtype, computing in float64 instead."""
  def run(*args):
    with mock.patch.object(ops_mhc, "jnp", _Float64Math()), \
         mock.patch.object(ops_norm, "jnp", _Float64Math()), \
         mock.patch.object(engram_lookup, "jnp", _Float64Math()), \
         mock.patch.object(engram_layer, "jnp", _Float64Math()):
      return fn(*args)
  return run


def test_loss_isolation_and_sharded_equals_single_device(cfg, split_model):
  """The indexer loss trains only indexer parameters and the LM loss never does (docs/design.md §5.5);
  on an 8-device mesh (data 2 × expert 2 × tensor 2) the losses, logits and both gradients equal
  the single-device results.

  Tolerance: sharding only reorders float32 arithmetic, so the sharded run must be as close to a
  float64 run of the same program as a single-device float32 run is: within 4× of the
  single-device error, plus 1e-5 of the leaf's scale (~100 float32 ulps: the float64 program
  keeps the routing in float32 as the model does, so it shares part of the single-device
  rounding). The single-device error is the larger of two samples, the run at the test's point
  and the run one ulp away (`float64_perturbed`, below). A wrong collective or a missing partial
  sum is off by O(|g|); every leaf's noise estimate is asserted under 1 % of the leaf.

  Why two samples (2026-12-07, a 2-core Xeon): the Engram gate σ(sign(z)·√|z|) has derivative
  1/(2√|z|), so where a gate's z is near 0 the gradient amplifies float32 rounding of z by
  ~1/(2|z|). At this batch one gate has |z| = 4.0e-4 (row 1, token 3, stream 3, Engram layer 1:
  z = 4.0007e-4 sharded, 4.0029e-4 on one device, 4.0030e-4 in float64, 4.0084e-4 one ulp away),
  and that token's cotangent at the embedding is 1.44e-6 (1.6e-4 of it) from float64 in the
  sharded run against 2.3e-8 on one device (every other token's ≤ 3.5e-7); the layer-0 and Engram
  gradients inherit it. With the Engram layer in float64 in the float64 program (its gate computes
  in float32 whatever its inputs' dtype, like the mHC ops), the one-sample rule failed on 10
  leaves, up to 3.95× its bound (layer 0's expert `w2`); before that change it passed only because
  the float64 program shared the float32 gate's rounding (largest ratio 0.81). On a 4-way data
  mesh a smooth gate σ(z) in its place takes the discrepancy away (every token's cotangent within
  3e-8 in both runs), as does leaving the Engram layers out: nothing in the sharded program is
  computed differently (its HLO holds no bfloat16). With the one-ulp sample the largest ratio is
  0.26, and the bound at most 2.7e-3 of any leaf.

  The float64 program runs the mHC ops, the RMS norm and the Engram layer in float64
  (`_in_float64`): they compute in float32 whatever their inputs' dtype, so a float64 program that
  kept them shared the single-device run's float32 roundings, and its "error" understated float32
  rounding where an mHC sum cancels. With the jitted init (≤ 4.8e-7 from the eager draw) the 4×
  rule then failed on layer 0's `ffn_hc/scale` gradient (3 entries): 9.57e-8 sharded against
  8.45e-8, as the single-device run agreed with that program to 1.26e-8. The token sum is not the
  cause: split into the 128 tokens' terms s_t (per-token copies of the scale), each run's gradient
  is within 1.3e-9 of Σ s_t (bound γ(127)·Σ|s_t|); one token's term (row 2, t = 21) is 2.9e-8 off
  on one device and 8.6e-8 sharded, every other one ≤ 6e-9. Against float64 mHC math that leaf's
  single-device error is 6.9e-8 (2e-5 of the leaf), the sharded 3.9e-8, the bound 3.1e-7: a
  gradient 3e-4 too large or missing a data shard's tokens fails it, 1e-4 does not (measured
  2026-12-02; largest ratio to the bound over all leaves 0.40 with the jitted init, 0.48 with the
  eager one).

  The embedding table's LM gradient gets a bound from its own arithmetic instead: row v is the
  sum, over the n_v tokens t that read row v, of the cotangent c_t at the embedding output. The
  program also returns c (a dense [B, T, D] leaf, held to the rule above), and in each run
  |g_v − Σ_t c_t| ≤ γ(n_v − 1)·Σ_t |c_t|, γ(k) = k·u / (1 − k·u), u = 2⁻²⁴: what a float32 sum
  of those terms may lose in any order, which is all that the data-axis reduction may change.
  Compared with float64 directly, the generic rule fails on CPUs where the single-device sum
  happens to be accurate (issue 32: 1.84e-6 sharded against a 1.51e-6 bound), although every
  term is as accurate as the rule demands. A missing partial sum is off by a whole data shard's
  contributions, |Σ c| ≫ γ·Σ|c|, and the test shows that the bound rejects one.

  Each mHC site's `base` gradient gets the same kind of bound: the program adds zero per-token
  copies to every site's `base` (so the ops see a [.., B, T, (2+n)n] base), returns their
  cotangents s (the per-token terms; a leaf held to the generic rule), and in each run
  |g − Σ_t s_t| ≤ γ(BT − 1)·Σ_t |s_t|. The generic rule failed on a 2-core Xeon (stop 63, both
  jax versions): layer 0's `attn_hc/base`, sharded 1.32e-7 from float64 against a 9.43e-8 bound,
  because that single-device run rounded the leaf's cancelling token sum to 1.51e-8 (4e-6 of the
  leaf), ~10× better than its terms' rounding warrants; reversing the batch rows gave the same
  1.51e-8, so one more single-device sample does not help. A lost data shard's terms are rejected.

  Both gradients come from one pullback of one forward pass (the program compiles ~40 % faster
  than with a jax.grad per loss). A broken copy whose indexer keeps the gradient of its input
  (`layers/indexer.py` without `stop_gradient(x_BxTxD)`) fails: the indexer loss's gradient
  reaches the residual stream's `ffn_hc` weights (checked).
  """
  graphdef, state = split_model
  bias = M.zero_moe_bias(cfg)
  batch = testing.packed_batch(cfg, 4, batch_size=4, boundaries=((13,), (), (7, 20), ()),
                               pad_from=(None, 27, None, 30))
  zero_BxTxD = np.zeros(batch["tokens"].shape + (cfg.hidden_size,), np.float32)

  B, T = batch["tokens"].shape
  model0 = nnx.merge(graphdef, state)
  sites = [path for path, node in nnx.iter_graph(model0) if isinstance(node, mhc_layer.MHCSite)]

  def at(model, path):
    for key in path:
      model = model[key] if isinstance(key, int) else getattr(model, key)
    return model

  # Per-token copies of every site's `base` (zeros added per token, [B, *stack, T, (2+n)n] with
  # the row first for the batch sharding): their cotangents are the per-token terms s_t of the
  # base gradient (rule in the docstring).
  name_of = lambda path: "/".join(map(str, path))   # noqa: E731
  zero_base = {name_of(path): np.zeros(
      (B,) + at(model0, path).base[...].shape[:-1] + (T,) + at(model0, path).base[...].shape[-1:],
      np.float32) for path in sites}

  def program(graphdef, cfg):
    def parts(params, batch, delta_BxTxD, delta_base):
      model = nnx.merge(graphdef, params)
      for path in sites:
        node, d = at(model, path), delta_base[name_of(path)]
        base = node.base[...]
        per_token = jnp.moveaxis(d, 0, -3).astype(base.dtype)    # [*stack, B, T, m]
        node.base.set_value(base[..., None, None, :] + per_token)
      h_BxTxD = model.embed_tokens(batch["tokens"]) + delta_BxTxD.astype(cfg.dtype)
      logits, aux = model(batch, bias, input_embeddings_BxTxD=h_BxTxD)
      return objective(cfg, logits, aux, batch)[1], logits

    def fn(params, batch, zero_BxTxD, zero_base):
      def outputs(q, d, e):
        p, logits = parts(q, batch, d, e)
        return p["lm_loss"], p["indexer_loss"], logits

      # One forward pass and its pullback, applied to each loss's one-hot cotangent: each
      # gradient is that loss's alone, and the program holds one forward, not three (~40 % less
      # to trace and compile than a jax.grad per loss).
      out, pullback = jax.vjp(outputs, params, zero_BxTxD, zero_base)
      one, nil = jnp.ones_like(out[0]), jnp.zeros_like(out[0])
      g_lm, c_lm, s_lm = pullback((one, nil, jnp.zeros_like(out[2])))
      g_idx, _, _ = pullback((nil, one, jnp.zeros_like(out[2])))
      return out, (g_lm, g_idx, c_lm, s_lm)
    return fn

  cfg64 = cfg.replace(dtype="float64", param_dtype="float64")
  with jax.enable_x64(True):
    g64, _ = nnx.split(nnx.eval_shape(lambda: M.Transformer(cfg64, nnx.Rngs(0))))
  # The tolerance rule of the docstring is assert_sharded_matches' float64 rule (4×, 1e-5).
  mesh = testing.cpu_mesh({"data": 2, "expert": 2, "tensor": 2})
  embed_grad = "[1][0]['embed'].value"
  # each site's base gradient as the outputs name it (jax's keystr of the LM gradient's path)
  base_grads = {name_of(path): "[1][0]" + "".join(f"[{k!r}]" for k in path) + "['base'].value"
                for path in sites}
  result = testing.assert_sharded_matches(program(graphdef, cfg),
                                          (state, batch, zero_BxTxD, zero_base),
                                          mesh, float64=_in_float64(program(g64, cfg64)),
                                          float64_ratio=4.0, float64_floor=1e-5,
                                          float64_own_rule=(embed_grad, *base_grads.values()),
                                          float64_perturbed=True)
  # The rule keeps its teeth with the second sample: every leaf's float32 noise estimate is under
  # 1 % of the leaf (at most 6.7e-4 of it, Engram layer 1's table, 2026-12-07), so a gradient
  # that lost a shard's partial sum fails it.
  samples = (jax.tree.leaves(result.single), jax.tree.leaves(result.single_perturbed))
  for (path, r), a, q in zip(jax.tree_util.tree_leaves_with_path(result.float64), *samples,
                             strict=True):
    r = np.asarray(r, np.float64)
    noise = max(np.abs(np.asarray(x, np.float64) - r).max(initial=0) for x in (a, q))
    assert noise <= 1e-2 * np.abs(r).max(initial=0), (
        f"output{jax.tree_util.keystr(path)}: float32 noise {noise:.3g} is over 1 % of the leaf")

  tokens = np.asarray(batch["tokens"]).reshape(-1)
  n_v = np.bincount(tokens, minlength=cfg.vocab_size)[:, None]
  u = 2.0 ** -24
  gamma = (n_v - 1).clip(0) * u / (1 - (n_v - 1).clip(0) * u)

  def row_sums(c_BxTxD):
    total, absolute = np.zeros((cfg.vocab_size, cfg.hidden_size)), np.zeros((cfg.vocab_size,
                                                                            cfg.hidden_size))
    c = np.asarray(c_BxTxD, np.float64).reshape(tokens.size, -1)
    np.add.at(total, tokens, c)
    np.add.at(absolute, tokens, np.abs(c))
    return total, absolute

  def excess(g_VxD, c_BxTxD):
    """max(|g − Σc| − γ·Σ|c|) over the table: ≤ 0 where the rule holds."""
    total, absolute = row_sums(c_BxTxD)
    return (np.abs(np.asarray(g_VxD, np.float64) - total) - gamma * absolute).max()

  for name, run in (("single device", result.single), ("sharded", result.sharded),
                    ("float64", result.float64)):
    g = run[1][0]["embed"][...]
    assert excess(g, run[1][2]) <= 0, (
        f"{name}: the embedding gradient is {excess(g, run[1][2]):.3g} beyond γ(n_v − 1)·Σ|c| "
        "from the sum of its token contributions")
  # The bound rejects a table gradient that lost the partial sum of batch rows 2-3 (a data shard).
  c_sharded = np.asarray(result.sharded[1][2])
  lost = np.asarray(result.sharded[1][0]["embed"][...]) - row_sums(
      np.concatenate([np.zeros_like(c_sharded[:2]), c_sharded[2:]]))[0]
  assert excess(lost, c_sharded) > 1e3 * u * np.abs(c_sharded).max()

  # Each mHC site's `base` gradient likewise: the sum over the B·T tokens of its per-token terms
  # s (the per-token copies' cotangents, a leaf held to the generic rule above), within what a
  # float32 sum of them may lose in any order; a data shard's lost terms are rejected.
  gamma_bt = (B * T - 1) * u / (1 - (B * T - 1) * u)
  for name, run in (("single device", result.single), ("sharded", result.sharded),
                    ("float64", result.float64)):
    flat = _flat(run[1][0])
    for key, path in base_grads.items():
      s_t = np.asarray(run[1][3][key], np.float64)                 # [B, *stack, T, m]
      g = np.asarray(flat[path[len('[1][0]'):]], np.float64)
      over = np.abs(g - s_t.sum(axis=(0, -2))) - gamma_bt * np.abs(s_t).sum(axis=(0, -2))
      assert over.max() <= 0, f"{name}: {path} is {over.max():.3g} beyond γ(BT − 1)·Σ|s|"
  s_sharded = np.asarray(result.sharded[1][3][next(iter(base_grads))], np.float64)
  lost = s_sharded[2:].sum(axis=(0, -2))
  bound = gamma_bt * np.abs(s_sharded).sum(axis=(0, -2))
  assert (np.abs(s_sharded.sum(axis=(0, -2)) - lost) - bound).max() > 0

  _, (g_lm, g_idx, _, _) = result.single
  flat_lm, flat_idx = _flat(g_lm), _flat(g_idx)
  indexer_keys = [k for k in flat_lm if "'indexer'" in k]
  assert indexer_keys
  for k in flat_lm:
    if k in indexer_keys:
      assert not np.any(flat_lm[k]), f"LM loss reached {k}"
    else:
      assert not np.any(flat_idx[k]), f"indexer loss reached {k}"
  assert all(np.any(flat_idx[k]) for k in indexer_keys if "wq_b" in k)
  assert any(np.any(flat_lm[k]) for k in flat_lm if "'attn'" in k)


def test_chunked_head_loss_equals_the_logits_loss(cfg, split_model):
  """`return_hidden` hands the loss the head's input and weight; with `lm_loss_chunk` the
  objective (a chunk of 24 tokens over 2 × 32, so one chunk is padded) equals the logits path's
  to float32 rounding (its gradients: tests/dsv41_jax/test_loss.py, against float64)."""
  graphdef, state = split_model
  bias = M.zero_moe_bias(cfg)
  batch = testing.packed_batch(cfg, 5, boundaries=((13,), ()), pad_from=(None, 27))

  @jax.jit
  def both(params):
    model = nnx.merge(graphdef, params)
    plain = objective(cfg, *model(batch, bias), batch)
    chunked = objective(cfg.replace(lm_loss_chunk=24), *model(batch, bias, return_hidden=True),
                        batch)
    return plain, chunked

  (a, pa), (b, pb) = both(state)
  np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
  assert float(pa["loss_tokens"]) == float(pb["loss_tokens"]) > 0


def _top_k_shapes(jaxpr, found):
  """Operand shapes of the `top_k` equations in a jaxpr and every jaxpr nested in it."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "top_k":
      found.append(tuple(eqn.invars[0].aval.shape))
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else (v,)):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _top_k_shapes(sub.jaxpr, found)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _top_k_shapes(sub, found)
  return sorted(found)


@pytest.mark.parametrize("scan", [True, False])
def test_remat_keeps_the_selection(cfg, scan):
  """Under layer remat the backward recomputes each layer's forward but not its top-k (the
  indexer's selection and pool, the MoE routing; `M.remat_policy`): the gradient's program holds
  the forward's top-k and no more."""
  c = cfg.replace(remat=True, scan_layers=scan)
  graphdef, state = nnx.split(M.abstract_model(c))
  bias = M.zero_moe_bias(c)
  batch = jax.tree.map(jnp.asarray, testing.packed_batch(c, 0))
  loss = lambda p: objective(c, *nnx.merge(graphdef, p)(batch, bias), batch)[0]
  forward = _top_k_shapes(jax.make_jaxpr(loss)(state).jaxpr, [])
  assert any(s[-1] != c.n_routed_experts for s in forward)       # the indexer's are there
  assert _top_k_shapes(jax.make_jaxpr(jax.grad(loss))(state).jaxpr, []) == forward


def test_remat_saves_keep_what_they_name(cfg):
  """`remat_saves` (`M.layer_remat_policy`): "experts" keeps the routed experts' gate|up product,
  so the gradient's program holds no more grouped products than without remat (one fewer per MoE
  layer body than plain remat); "projections" also keeps the dense products (fewer dot_generals,
  still more than without remat: the attention's own products are recomputed). An unknown entry
  is a ConfigError naming the known ones."""
  batch = jax.tree.map(jnp.asarray, testing.packed_batch(cfg, 0))

  def counts(**kw):
    c = cfg.replace(scan_layers=True, **kw)
    graphdef, state = nnx.split(M.abstract_model(c))
    loss = lambda p: objective(c, *nnx.merge(graphdef, p)(batch, M.zero_moe_bias(c)), batch)[0]
    jaxpr = jax.make_jaxpr(jax.grad(loss))(state).jaxpr
    return _count(jaxpr, "ragged_dot_general"), _count(jaxpr, "dot_general")

  bodies = len(build_layer_plan(cfg).runs)  # one scan body per run (a run of one is unrolled)
  off, on = counts(remat=False), counts(remat=True)
  experts = counts(remat=True, remat_saves=("experts",))
  both = counts(remat=True, remat_saves=("projections", "experts"))
  assert cfg.moe_dispatch == "dropless" and on[0] - off[0] == bodies
  assert experts[0] == both[0] == off[0] and experts[1] == on[1]
  assert off[1] < both[1] < on[1]
  with pytest.raises(ConfigError, match=r"remat_saves has unknown entries \['mhc'\]"):
    cfg.replace(remat_saves=("experts", "mhc"))


def _count(jaxpr, name: str, named: str | None = None) -> int:
  """Equations of primitive `name` (a `pallas_call` whose name holds `named`), nested included."""
  return len(testing.jaxpr_eqns(jaxpr, name, lambda e: named is None or named in str(e.params)))


@pytest.mark.parametrize("scan", [True, False])
def test_each_selection_is_planned_once(cfg, scan):
  """With the attention and indexer kernels (interpreted on the CPU), the layer that selects sorts
  the selection's slots once (the attention op's plan, `attention.selection_plan`); its attention,
  its Reuse layers' and their backward passes reuse it, and layer remat recomputes neither the
  plan nor the selection: against the same program with the reference attention, the gradient's
  program holds one more sort per selecting layer (per selecting kind of a scanned run), and the
  Triton scores kernel as many times as the forward's. (Unrolled, it fails with 10 more sorts
  when the plan is not named for remat, and with 12 when the attention is not handed it.)"""
  base = cfg.replace(remat=True, scan_layers=scan,
                     ops=dict(indexer_topk="kernel", sparse_attention="reference"))
  kern = base.replace(ops=dict(indexer_topk="kernel", sparse_attention="kernel"))
  batch = jax.tree.map(jnp.asarray, testing.packed_batch(cfg, 0))

  def programs(c):
    graphdef, state = nnx.split(M.abstract_model(c))
    loss = lambda p: objective(c, *nnx.merge(graphdef, p)(batch, M.zero_moe_bias(c)), batch)[0]
    return jax.make_jaxpr(loss)(state).jaxpr, jax.make_jaxpr(jax.grad(loss))(state).jaxpr

  plan = build_layer_plan(cfg)
  selecting = sum(sum(k.owns_indexer for k in r.kinds) if scan and r.n_layers > 1
                  else sum(l.owns_indexer for l in r.layers) for r in plan.runs)
  (bf, bg), (kf, kg) = programs(base), programs(kern)
  assert _count(kg, "sort") - _count(bg, "sort") == selecting
  assert _count(kf, "sort") - _count(bf, "sort") == selecting
  scores = _count(kf, "pallas_call", "indexer_scores")
  assert scores == selecting and _count(kg, "pallas_call", "indexer_scores") == scores
