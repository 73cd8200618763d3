"""dsv41_jax/block.py: the layer as the model stacks it.

1. The single-pass mHC wiring of the whole model (docs/design.md §3.3) against a float64
restatement:

  pre_mix ← e_0
  for each layer:
    a = hc(X; attn site);  X = a_postᵀ·Attn(attn_norm(collapse(X, pre_mix))) + a_combᵀX
    f = hc(X; ffn site);   X = f_postᵀ·MoE(ffn_norm(collapse(X, a_pre))) + f_combᵀX
    pre_mix ← f_pre
  logits = head(final_norm(collapse(X, pre_mix)))

Four SWA layers (CED needs an even depth; two runs of two, so the wiring is checked inside a
scanned run and across the encoder / decoder boundary), packed rows, mHC parameters random enough
that every coefficient is token-dependent. The sublayers are restated from their own float64
references (`test_sparse_attention`, `test_attention`, `test_moe`); the coefficients from
`test_mhc.ref_hc`. Per-layer parameters are found in `nnx.state` by `layer_path`, the one place
that knows how the model stores its layers. (Layer 0's e_0 is exact rather than observable: its
streams are equal, so any positive collapse weights give the same normalised attention input.)

2. What a layer reads from the layers before it, observed on the streams entering every layer of
`unrolled_forward` (the model's per-layer pieces one layer at a time, no runs and no scan; its
logits equal the scanned model's): an Engram layer changes nothing before it (§7.3), and a Reuse
layer attends with the latest top-k of its run, so a Reindex layer in between changes what the
Reuse layers after it read (§2, §5.5).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import testing
from dsv41_jax.block import Context, StreamState, layer_forward
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers import mhc
from dsv41_jax.layers.rope import layer_inv_freq
from dsv41_jax.model import Transformer, zero_moe_bias
from optim.table import flatten_params, path_str
from tests.dsv41_jax.layers.test_attention import np_rms, np_rope
from tests.dsv41_jax.layers.test_mhc import ref_hc
from tests.dsv41_jax.layers.test_moe import np_moe, np_route
from tests.pallas_kernels.ops.test_sparse_attention import np_attend

N_LAYERS, B, T = 4, 2, 12


def _cfg(**ops) -> ModelConfig:
  return ModelConfig(
      vocab_size=32, hidden_size=16, num_hidden_layers=N_LAYERS, num_attention_heads=2,
      head_dim=16, qk_rope_head_dim=8, q_lora_rank=12, o_groups=1, o_lora_rank=8,
      sliding_window=4, compress_ratios=(0,) * N_LAYERS, kv_source_layer_ids=(),
      index_source_layer_ids=(), engram_layer_ids=(), n_routed_experts=4, num_experts_per_tok=2,
      moe_intermediate_size=8, swiglu_limit=3.0, hc_mult=3, hc_sinkhorn_iters=6, seq_len=T,
      dtype="float32", remat=False, ops=ops)


def layer_path(plan, layer: int, name: str) -> tuple[str, int | None]:
  """Where layer `layer`'s parameter `name` is stored: (path in `nnx.state`, row of the stack).
  `name` is a path inside the layer: "core/attn/wo_b" (every layer), "publisher/indexer/wq_b"
  (Full and Reindex layers), "engram/table" (the run's Engram layer; not stacked, row None).
  Adapt this when the storage changes."""
  r, i = plan.run_of(layer)
  run = plan.runs[r]
  part, rest = name.split("/", 1)
  if part == "core":
    return f"runs/{r}/core/{rest}", i
  if part == "publisher" and plan[layer].owns_indexer:
    return f"runs/{r}/{run.kinds[run.kind_of[i]].kind_name}/{rest}", run.slot_of[i]
  if part == "engram" and run.engram_layer == layer:
    return f"runs/{r}/engram/{rest}", None
  raise KeyError(f"layer {layer} ({plan[layer].mode}) has no parameter {name}")


def layer_params(flat: dict[str, np.ndarray], cfg: ModelConfig, layer: int) -> dict:
  """Layer `layer`'s core parameters, un-stacked, keyed by their path inside the core
  ("attn_hc/fn", "attn/wq_a", "moe/experts/w1", ...)."""
  prefix, i = layer_path(build_layer_plan(cfg), layer, "core/")
  return {p[len(prefix):]: v[i] for p, v in flat.items() if p.startswith(prefix)}


def _randomize(model: Transformer, rng) -> None:
  """Token-dependent mHC coefficients (mix logits of unit size), non-trivial norms and sinks."""
  params = nnx.state(model, nnx.Param)

  def draw(path, v):
    shape = v.shape
    if path.endswith("_hc/fn"):
      return rng.standard_normal(shape) / np.sqrt(shape[-1]) * 2.0
    if path.endswith("_hc/base") or path.endswith("attn_sink"):
      return rng.standard_normal(shape)
    if path.endswith("scale"):                     # norm weights and the mHC scales
      return rng.uniform(0.5, 1.5, shape)
    return v

  flat = dict(flatten_params(params))
  new = {p: jnp.asarray(draw(p, np.asarray(v)), jnp.float32) for p, v in flat.items()}
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  nnx.update(model, jax.tree_util.tree_unflatten(
      treedef, [new[path_str(k)] for k, _ in leaves]))


def _collapse(X, pre):
  return np.einsum("btnd,btn->btd", X, pre)


def _expand(X, post, comb, F):
  return post[..., None] * F[:, :, None, :] + np.einsum("btjk,btjd->btkd", comb, X)


def _attention(P, cfg, spec, x, pos, seg):
  """SWA attention of docs/design.md §4.1–4.4 (no global branch), float64."""
  inv, eps = layer_inv_freq(cfg, spec), cfg.rms_norm_eps
  cq = np_rms(x @ P["attn/wq_a"], P["attn/q_norm/scale"], eps)
  q = np_rope(np.einsum("btq,qhd->bthd", cq, P["attn/wq_b"]), pos, inv)
  k = np_rope(np_rms(x @ P["attn/wkv"], P["attn/kv_norm/scale"], eps), pos, inv)
  o, _ = np_attend(q, k, seg, P["attn/attn_sink"], cfg.sliding_window, cfg.head_dim ** -0.5)
  o = np_rope(o, pos, inv, sign=-1.0)
  u = np.einsum("btgi,gio->btgo", o.reshape(B, T, cfg.o_groups, -1), P["attn/wo_a"])
  return u.reshape(B, T, -1) @ P["attn/wo_b"]


def _moe(P, cfg, x, seg):
  image = np.zeros(seg.shape, bool)
  w, sel, _ = np_route(x, P["moe/router"], np.zeros((2, cfg.n_routed_experts)), image,
                        cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.gate_temp)
  experts = {k: P[f"moe/experts/{k}"] for k in ("w1", "w3", "w2")}
  experts.update({f"shared_{k}": P[f"moe/shared/{k}"] for k in ("w1", "w3", "w2")})
  return np_moe(experts, x, w, sel, seg != 0, cfg.swiglu_limit)


def _bf16(X):
  """X rounded to bfloat16 (round to nearest even), as float64."""
  return np.asarray(jnp.asarray(X, jnp.bfloat16), np.float64)


def reference_logits(flat, cfg, tokens, pos, seg, store=lambda X: X):
  """docs/design.md §3.3 in float64, layer by layer; `store` is what writing the streams does to
  them (bfloat16 streams: `_bf16`)."""
  hc = lambda X, P, site: ref_hc(X, P[f"{site}/fn"], P[f"{site}/base"], P[f"{site}/scale"],
                                 iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                                 norm_eps=cfg.rms_norm_eps)
  eps, n = cfg.rms_norm_eps, cfg.hc_mult
  X = store(np.repeat(flat["embed"][tokens][:, :, None, :], n, axis=2))
  pre_mix = np.zeros((B, T, n))
  pre_mix[..., 0] = 1.0                                                   # e_0
  for layer, spec in enumerate(build_layer_plan(cfg).layers):
    P = layer_params(flat, cfg, layer)
    a_pre, a_post, a_comb = hc(X, P, "attn_hc")
    x = np_rms(_collapse(X, pre_mix), P["attn_norm/scale"], eps)           # previous site's pre
    X = store(_expand(X, a_post, a_comb, _attention(P, cfg, spec, x, pos, seg)))
    f_pre, f_post, f_comb = hc(X, P, "ffn_hc")
    x = np_rms(_collapse(X, a_pre), P["ffn_norm/scale"], eps)              # the attention site's
    X = store(_expand(X, f_post, f_comb, _moe(P, cfg, x, seg)))
    pre_mix = f_pre
  h = np_rms(_collapse(X, pre_mix), flat["final_norm/scale"], eps)        # last FFN site's pre
  return h @ flat["head"]


def _inputs(cfg, rng):
  """Tokens, positions and segment ids of two packed rows (two documents; padding at the end)."""
  tokens = rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[0, 5:] = 2                                   # two documents in row 0
  seg[1, 10:] = 0                                  # padding at the end of row 1
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    for t in range(1, T):
      pos[b, t] = pos[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
  return tokens, pos, seg


def _model_logits(cfg, seed=0):
  """(logits of a randomized model on packed rows, its float64 parameters, tokens, pos, seg)."""
  rng = np.random.default_rng(seed)
  model = Transformer(cfg, nnx.Rngs(1))
  _randomize(model, rng)
  tokens, pos, seg = _inputs(cfg, rng)
  batch = dict(tokens=jnp.asarray(tokens), positions=jnp.asarray(pos),
               segment_ids=jnp.asarray(seg))
  logits, _ = nnx.jit(lambda m, b: m(b, zero_moe_bias(cfg)))(model, batch)
  flat = {p: np.asarray(v, np.float64) for p, v in flatten_params(nnx.state(model, nnx.Param))}
  return np.asarray(logits, np.float64), flat, tokens, pos, seg


BOUNDARY = pytest.mark.parametrize("boundary", [False, True], ids=["split", "single_pass_boundary"])


@BOUNDARY
@pytest.mark.parametrize("ops", [{}, {"hc_coefficients": "kernel", "hc_site": "kernel"}],
                         ids=["default", "mhc_kernels"])
def test_model_logits_equal_the_single_pass_restatement(ops, boundary):
  # Also with the mHC kernels (pallas_kernels/mhc_rows.py and mhc.py, interpreted): the site and the
  # coefficients in the model against the same float64 schedule, at the same tolerance; and with
  # each MoE output written by the next layer's attention site (`single_pass_boundary`).
  cfg = dataclasses.replace(_cfg(**ops), single_pass_boundary=boundary)
  logits, flat, tokens, pos, seg = _model_logits(cfg)
  want = reference_logits(flat, cfg, tokens, pos, seg)
  scale = np.abs(want).max()
  np.testing.assert_allclose(logits, want, rtol=0, atol=3e-6 * scale)


@BOUNDARY
@pytest.mark.parametrize("ops", [{}, {"hc_coefficients": "kernel", "hc_site": "kernel"}],
                         ids=["default", "mhc_kernels"])
def test_bfloat16_streams_are_rounded_where_the_model_writes_them(ops, boundary):
  # hc_stream_dtype="bfloat16": X⁰ and every expand's X' rounded to bfloat16 once, everything else
  # (coefficients, collapse, norms, sublayers) as in float32. The restatement rounds at the same
  # three places, and the float32 test's tolerance holds (1.6e-7 measured: float32 arithmetic moved
  # no value across a bfloat16 rounding boundary here); the unrounded restatement is 8e-3 off.
  cfg = dataclasses.replace(_cfg(**ops), hc_stream_dtype="bfloat16", single_pass_boundary=boundary)
  logits, flat, tokens, pos, seg = _model_logits(cfg)
  want = reference_logits(flat, cfg, tokens, pos, seg, store=_bf16)
  unrounded = reference_logits(flat, cfg, tokens, pos, seg)
  scale = np.abs(want).max()
  err, off = np.abs(logits - want).max() / scale, np.abs(unrounded - want).max() / scale
  print(f"bf16 streams: {err:.2e} from the rounded restatement, {off:.2e} rounded vs not")
  assert err < 3e-6 < off / 100, (err, off)


# --- 2. what a layer reads from the layers before it ---------------------------------------------


def unrolled_forward(model: Transformer, batch: dict, bias_Lx2xE: jax.Array
                     ) -> tuple[list[StreamState], jax.Array]:
  """The streams entering each layer and leaving the last (L + 1 `StreamState`s), and the logits,
  by the model's per-layer pieces (`Transformer.layer`, `block.layer_forward`) one layer at a time:
  no runs, no scan; an Engram layer's memory looked up and injected at that layer."""
  cfg, plan = model.cfg, model.plan
  ctx = Context(jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]),
                jnp.asarray(batch["image_mask"]), {l: jnp.asarray(v)
                                                   for l, v in batch["engram_ids"].items()})
  token_mask = (ctx.segment_ids_BxT > 0) & ~ctx.image_mask_BxT
  state = model.initial_state(model.embed_tokens(jnp.asarray(batch["tokens"])))
  states = []
  for spec in plan:
    if spec.index == plan.num_encoder_layers:     # the decoder builds its own compressed KV (§6)
      state = StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN)
    if spec.owns_compressor and state.topk_BxTxK is None:
      # the first Full layer of a half selects anew; nothing earlier to carry
      B, T = ctx.segment_ids_BxT.shape
      state = state._replace(topk_BxTxK=jnp.zeros((B, T, 0), jnp.int32))
    states.append(state)
    core, pub, engram = model.layer(spec.index)
    if engram is not None:
      X, _ = engram.inject(state.X_BxTxNxD, engram.memory(ctx.engram_ids[spec.index]), token_mask)
      state = state._replace(X_BxTxNxD=X)
    state, _ = layer_forward(cfg, [spec], core, [pub], state, ctx, bias_Lx2xE[spec.index])
  states.append(state)
  x = model.final_norm(mhc.collapse(state.X_BxTxNxD, state.pre_mix_BxTxN)).astype(cfg.dtype)
  logits = jnp.einsum("btd,dv->btv", x, model.head[...].astype(cfg.dtype),
                      preferred_element_type=jnp.float32)
  return states, logits


def with_row(params, path: str, row: int | None, value):
  """`params` with row `row` of the stacked parameter at `path` set to `value` (with `row` None,
  the whole parameter)."""
  def put(key, leaf):
    if path_str(key) != path:
      return leaf
    return jnp.broadcast_to(value, leaf.shape) if row is None else leaf.at[row].set(value)
  return jax.tree_util.tree_map_with_path(put, params)


@pytest.fixture(scope="module")
def reads():
  """tiny_config with Reuse on both sides of a Reindex in the decoder run (4 Full, 5 Reuse,
  6 Reindex, 7 Reuse) and Engram at layer 2, inside the encoder's scanned run (1 Full, 2 Reuse +
  Engram, 3 Reuse); the scanned model and `unrolled_forward`, each compiled once."""
  cfg = testing.tiny_config(index_source_layer_ids=(1, 4, 6), engram_layer_ids=(2,))
  plan = build_layer_plan(cfg)
  assert [l.mode for l in plan] == ["swa", "full", "reuse", "reuse", "full", "reuse", "reindex",
                                    "reuse"]
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(5)))
  params = nnx.as_pure(params)
  rng = np.random.default_rng(6)
  batch = testing.packed_batch(cfg, rng)
  bias = jnp.asarray(rng.normal(size=(cfg.num_hidden_layers, 2, cfg.n_routed_experts)) * 0.1,
                     jnp.float32)
  model = jax.jit(lambda p: nnx.merge(graphdef, p)(batch, bias))
  unrolled = jax.jit(lambda p: unrolled_forward(nnx.merge(graphdef, p), batch, bias))

  def run(p):
    """(streams entering each layer and after the last, the model's logits and aux); the
    unrolled logits equal the scanned model's (the tolerance of test_model's scan-vs-unrolled)."""
    logits, aux = model(p)
    states, logits_u = unrolled(p)
    np.testing.assert_allclose(np.asarray(logits_u), np.asarray(logits), rtol=1e-6, atol=1e-6)
    return states, np.asarray(logits), {k: np.asarray(v) for k, v in aux.items()}

  return cfg, plan, params, batch, rng, run


def test_engram_changes_nothing_before_its_layer(reads):
  """Engram at layer ℓ = 2 with a zeroed and a random table: the streams entering layers 0…ℓ are
  bitwise equal, those leaving ℓ and every later layer differ; the model's per-layer balance loss
  agrees (equal before ℓ, different from ℓ on) and only layer ℓ's gate is open."""
  cfg, plan, params, batch, rng, run = reads
  ell = 2
  path, row = layer_path(plan, ell, "engram/table")
  shape = np.shape(dict(flatten_params(params))[path])
  states, logits, aux = {}, {}, {}
  for name, table in (("zero", np.zeros(shape)), ("random", rng.standard_normal(shape))):
    states[name], logits[name], aux[name] = run(with_row(params, path, row,
                                                        jnp.asarray(table, jnp.float32)))
  real = batch["segment_ids"] > 0
  for i, (s0, s1) in enumerate(zip(states["zero"], states["random"])):
    if i <= ell:
      np.testing.assert_array_equal(np.asarray(s1.X_BxTxNxD), np.asarray(s0.X_BxTxNxD))
      np.testing.assert_array_equal(np.asarray(s1.pre_mix_BxTxN), np.asarray(s0.pre_mix_BxTxN))
    else:
      delta = np.abs(np.asarray(s1.X_BxTxNxD) - np.asarray(s0.X_BxTxNxD))[real]
      assert delta.max() > 1e-2, (i, delta.max())
  balance = {k: a["balance_loss"] for k, a in aux.items()}
  np.testing.assert_array_equal(balance["random"][:ell], balance["zero"][:ell])
  assert np.all(balance["random"][ell:] != balance["zero"][ell:])
  assert np.abs(logits["random"] - logits["zero"]).max() > 1e-2
  gate = aux["random"]["engram_gate_N"]
  assert np.all(gate[ell] > 0) and not np.any(np.delete(gate, ell, axis=0))


def test_reuse_reads_the_latest_top_k_of_its_run(reads):
  """Layer 6 (Reindex) sits between the Reuse layers 5 and 7. With its attention output projection
  zeroed, layer 6's own selection cannot reach the streams through its attention; a new draw of its
  indexer query weights then changes only the top-k it publishes. Layer 7 attends with that top-k:
  its output changes. The streams entering layers 0…7 (layer 5 included) and the top-k layer 5
  reads are bitwise unchanged."""
  cfg, plan, params, batch, rng, run = reads
  reindex, before, after = 6, 5, 7
  assert (plan[reindex].mode, plan[before].mode, plan[after].mode) == ("reindex", "reuse", "reuse")
  wo_b, row = layer_path(plan, reindex, "core/attn/wo_b")
  base = with_row(params, wo_b, row, 0.0)
  flat = dict(flatten_params(base))
  new = base
  for name in ("publisher/indexer/wq_b", "publisher/indexer/weights_proj"):
    path, slot = layer_path(plan, reindex, name)
    shape = np.shape(flat[path])[1:]
    new = with_row(new, path, slot, jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]),
                                                jnp.float32))
  (s0, logits0, aux0), (s1, logits1, aux1) = run(base), run(new)

  topk = lambda s, i: np.asarray(s[i].topk_BxTxK)
  np.testing.assert_array_equal(topk(s1, before), topk(s0, before))       # layer 4's selection
  np.testing.assert_array_equal(topk(s1, reindex), topk(s0, reindex))
  assert np.any(topk(s1, after) != topk(s0, after))                       # layer 6 selected anew
  for i in range(after + 1):
    np.testing.assert_array_equal(np.asarray(s1[i].X_BxTxNxD), np.asarray(s0[i].X_BxTxNxD))
  real = batch["segment_ids"] > 0
  delta = np.abs(np.asarray(s1[after + 1].X_BxTxNxD) - np.asarray(s0[after + 1].X_BxTxNxD))[real]
  assert delta.max() > 1e-2, delta.max()
  # the scanned model: every layer up to the Reindex routes the same streams; layer 7 does not
  np.testing.assert_array_equal(aux1["balance_loss"][:after], aux0["balance_loss"][:after])
  assert aux1["balance_loss"][after] != aux0["balance_loss"][after]
  assert np.abs(logits1 - logits0).max() > 1e-3


def test_single_pass_boundary_same_model_through_the_site_op(monkeypatch):
  """`single_pass_boundary`: each layer's MoE output written by the next layer's attention site
  (the op `hc_site`) instead of at the layer's end. On tiny_config (Engram runs, which settle the
  streams before their injection; the encoder's end; the head) the logits are bitwise those of
  the split form; on the small stack with layer remat the loss is bitwise and every gradient within
  1e-6 of the largest of its parameter (3.4e-7 measured: float32 sums in another order); and the unrolled forward
  calls `hc_site` at both sites of every layer where the split form calls it at the MoE site only."""
  def loss_grads(cfg, batch):
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(3)))
    def loss(p):
      logits, _ = nnx.merge(graphdef, p)(batch, zero_moe_bias(cfg))
      return jnp.mean(jnp.square(logits)), logits
    (l, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(nnx.as_pure(params))
    return np.asarray(l), np.asarray(logits), dict(flatten_params(jax.tree.map(np.asarray, g)))

  rng = np.random.default_rng(21)
  tokens, pos, seg = _inputs(_cfg(), rng)
  batch = dict(tokens=jnp.asarray(tokens), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
  split, fused = (loss_grads(dataclasses.replace(_cfg(), remat=True, single_pass_boundary=b), batch)
                  for b in (False, True))
  np.testing.assert_array_equal(fused[0], split[0])
  np.testing.assert_array_equal(fused[1], split[1])
  for path, g in split[2].items():
    np.testing.assert_allclose(fused[2][path], g, rtol=0, atol=1e-6 * np.abs(g).max(), err_msg=path)

  cfg = testing.tiny_config()
  params = nnx.as_pure(nnx.split(Transformer(cfg, nnx.Rngs(5)))[1])
  tiny = testing.packed_batch(cfg, np.random.default_rng(6))
  bias = zero_moe_bias(cfg)

  def forward(c):        # the model of config `c` on `params` (the configs differ in no parameter)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(c, nnx.Rngs(5))))[0]
    return lambda p: nnx.merge(graphdef, p)(tiny, bias)[0]

  logits = {b: np.asarray(jax.jit(forward(dataclasses.replace(cfg, single_pass_boundary=b)))(
      params)) for b in (False, True)}
  np.testing.assert_array_equal(logits[True], logits[False])

  from pallas_kernels import dispatch
  calls = []
  real_call = dispatch.call
  monkeypatch.setattr(dispatch, "call", lambda name, *a, **k: calls.append(name) or
                      real_call(name, *a, **k))
  for b in (False, True):
    c = dataclasses.replace(cfg, scan_layers=False, single_pass_boundary=b)
    calls.clear()
    jax.eval_shape(forward(c), params)
    assert calls.count("hc_site") == (2 if b else 1) * c.num_hidden_layers, (b, calls)
