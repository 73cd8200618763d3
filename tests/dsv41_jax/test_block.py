"""The single-pass mHC wiring of the whole model (docs/design.md §3.3) against a float64 restatement.

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
`test_mhc.ref_hc`. Per-layer parameters are read from `nnx.state` paths by `layer_params`, the one
place that knows how the model stores its layers. (Layer 0's e_0 is exact rather than observable: its streams are equal, so
any positive collapse weights give the same normalised attention input.)
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers.rope import layer_inv_freq
from dsv41_jax.model import Transformer, zero_moe_bias
from optim.table import flatten_params, path_str
from tests.dsv41_jax.layers.test_attention import np_rms, np_rope
from tests.dsv41_jax.layers.test_mhc import ref_hc
from tests.dsv41_jax.layers.test_moe import np_moe, np_route
from tests.dsv41_jax.layers.test_sparse_attention import np_attend

N_LAYERS, B, T = 4, 2, 12


def _cfg() -> ModelConfig:
  return ModelConfig(
      vocab_size=32, hidden_size=16, num_hidden_layers=N_LAYERS, num_attention_heads=2,
      head_dim=16, qk_rope_head_dim=8, q_lora_rank=12, o_groups=1, o_lora_rank=8,
      sliding_window=4, compress_ratios=(0,) * N_LAYERS, kv_source_layer_ids=(),
      index_source_layer_ids=(), engram_layer_ids=(), n_routed_experts=4, num_experts_per_tok=2,
      moe_intermediate_size=8, swiglu_limit=3.0, hc_mult=3, hc_sinkhorn_iters=6, seq_len=T,
      dtype="float32", remat=False)


def layer_params(flat: dict[str, np.ndarray], cfg: ModelConfig, layer: int) -> dict:
  """Layer `layer`'s parameters, un-stacked, keyed by their path inside the layer
  ("attn_hc/fn", "attn/wq_a", "moe/experts/w1", ...). Adapt this when the storage changes."""
  plan = build_layer_plan(cfg)
  if hasattr(plan, "run_of"):                     # runs/<r>/core/..., stacked per run
    r, i = plan.run_of(layer)
    prefix = f"runs/{r}/core/"
  else:                                           # segments/<s>/layers/<j>/..., stacked repeats
    s, seg = next((s, g) for s, g in enumerate(plan.segments)
                  if g.first_layer <= layer < g.first_layer + g.repeats * len(g.unit))
    i, j = divmod(layer - seg.first_layer, len(seg.unit))
    prefix = f"segments/{s}/layers/{j}/"
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


def reference_logits(flat, cfg, tokens, pos, seg):
  """docs/design.md §3.3 in float64, layer by layer."""
  hc = lambda X, P, site: ref_hc(X, P[f"{site}/fn"], P[f"{site}/base"], P[f"{site}/scale"],
                                 iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                                 norm_eps=cfg.rms_norm_eps)
  eps, n = cfg.rms_norm_eps, cfg.hc_mult
  X = np.repeat(flat["embed"][tokens][:, :, None, :], n, axis=2)
  pre_mix = np.zeros((B, T, n))
  pre_mix[..., 0] = 1.0                                                   # e_0
  for layer, spec in enumerate(build_layer_plan(cfg).layers):
    P = layer_params(flat, cfg, layer)
    a_pre, a_post, a_comb = hc(X, P, "attn_hc")
    x = np_rms(_collapse(X, pre_mix), P["attn_norm/scale"], eps)           # previous site's pre
    X = _expand(X, a_post, a_comb, _attention(P, cfg, spec, x, pos, seg))
    f_pre, f_post, f_comb = hc(X, P, "ffn_hc")
    x = np_rms(_collapse(X, a_pre), P["ffn_norm/scale"], eps)              # the attention site's
    X = _expand(X, f_post, f_comb, _moe(P, cfg, x, seg))
    pre_mix = f_pre
  h = np_rms(_collapse(X, pre_mix), flat["final_norm/scale"], eps)        # last FFN site's pre
  return h @ flat["head"]


def test_model_logits_equal_the_single_pass_restatement():
  cfg = _cfg()
  rng = np.random.default_rng(0)
  model = Transformer(cfg, nnx.Rngs(1))
  _randomize(model, rng)
  tokens = rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[0, 5:] = 2                                   # two documents in row 0
  seg[1, 10:] = 0                                  # padding at the end of row 1
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    for t in range(1, T):
      pos[b, t] = pos[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
  batch = dict(tokens=jnp.asarray(tokens), positions=jnp.asarray(pos),
               segment_ids=jnp.asarray(seg))
  logits, _ = nnx.jit(lambda m, b: m(b, zero_moe_bias(cfg)))(model, batch)

  flat = {p: np.asarray(v, np.float64) for p, v in flatten_params(nnx.state(model, nnx.Param))}
  want = reference_logits(flat, cfg, tokens, pos, seg)
  scale = np.abs(want).max()
  np.testing.assert_allclose(np.asarray(logits, np.float64), want, rtol=0, atol=3e-6 * scale)
