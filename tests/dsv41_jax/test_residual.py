"""The residual switch (`ModelConfig.residual`, dsv41_jax/block.py): "plain" is the standard pre-norm
residual with one stream and no mHC parameters (the ablation baseline of issue 17).

* the plain parameter tree has no mHC site; every other parameter is that of the mHC model, and
  the ledger's counts drop by exactly the mHC parameters;
* a two-layer plain model's logits are X ← X + F(norm(X)) composed by hand from its own sublayers
  (attention, MoE, norms, head), with nothing else in between;
* on the micro model (Full CSA2 layers, indexer, Engram) the plain model equals mHC at one stream
  with identity coefficients (fn = 0, hc_eps 0: pre 1/2 before a scale-free norm, post = comb = 1);
* decoding a plain model token by token gives the forward pass's logits;
* an unknown residual, or a plain one with several streams, is refused by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from configs.common import base_config, model_config
from dsv41_jax import ledger, model as M, testing
from dsv41_jax.errors import ConfigError
from dsv41_jax.param_paths import per_layer_params
from launch.step import model_inputs
from optim.table import flatten_params


def _micro(**changes):
  fields = dict(tiny.get_config("micro").model)
  fields.update(changes)
  return model_config(base_config(model=fields))


def _batch(cfg, tokens):
  """One document per row, the model's keys as training makes them (`dsv41_jax.testing`)."""
  batch = model_inputs(testing.make_batch(cfg, tokens, np.ones_like(tokens)))
  return jax.tree.map(jnp.asarray, batch)


def _shapes(cfg):
  return {p: tuple(v.shape) for p, v in flatten_params(M.abstract_params(cfg))}


def test_plain_residual_has_no_mhc_parameters_and_the_ledger_counts_none():
  wide = dict(head_dim=32, index_head_dim=32)  # the ledger's cache layout needs whole FP blocks
  plain, mhc = _micro(residual="plain", hc_mult=1, **wide), _micro(hc_mult=1, **wide)
  p, m = _shapes(plain), _shapes(mhc)
  hc = {k: v for k, v in m.items() if "attn_hc/" in k or "ffn_hc/" in k}
  assert hc and not any("_hc" in k for k in p)
  assert p == {k: v for k, v in m.items() if k not in hc}
  n_hc = sum(int(np.prod(s)) for s in hc.values())
  lp, lm = ledger.ledger(plain), ledger.ledger(mhc)
  assert lp["total_params"] == sum(int(np.prod(s)) for s in p.values())
  assert lp["total_params"] == lm["total_params"] - n_hc
  assert lp["backbone_params"] == lm["backbone_params"] - n_hc
  assert lp["active_params_decode"] == lm["active_params_decode"] - n_hc
  # FLOPs: 6 per token per weight of mHC's matrices (`fn`); base and scale are elementwise
  n_hc_matrices = sum(int(np.prod(s)) for k, s in hc.items() if k.endswith("/fn"))
  assert 0 < n_hc_matrices < n_hc
  np.testing.assert_allclose(lp["train_flops_per_token"],
                             lm["train_flops_per_token"] - 6 * n_hc_matrices, rtol=1e-12)
  assert not any("_hc/" in rest for _, rest, _ in per_layer_params(plain, M.abstract_params(plain)))


def test_plain_model_is_a_prenorm_residual_stack():
  """Two SWA layers (no CSA2 state, no Engram): logits = head(final_norm(h₂)) with
  h' = h + Attn(attn_norm(h)), h_next = h' + MoE(ffn_norm(h')), from the model's own sublayers."""
  cfg = _micro(residual="plain", hc_mult=1, compress_ratios=(0, 0), kv_source_layer_ids=(),
               index_source_layer_ids=(), candidate_source_layer_id=None, engram_layer_ids=())
  model = M.Transformer(cfg, nnx.Rngs(1))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (2, cfg.seq_len))
  batch = _batch(cfg, tokens)
  bias = jnp.asarray(rng.normal(0, 0.1, (cfg.num_hidden_layers, 2, cfg.n_routed_experts)),
                     jnp.float32)
  logits, _ = model(batch, bias)

  seg = batch["segment_ids"]
  h = model.embed_tokens(batch["tokens"]).astype(jnp.float32)
  for i in range(cfg.num_hidden_layers):
    core, pub, engram = model.layer(i)
    assert pub is None and engram is None
    x = core.attn_norm(h)
    y, _, _ = core.attn(x, positions_BxT=batch["positions"], segment_ids_BxT=seg,
                        c_q_BxTxQ=core.attn.q_latent(x))
    h = h + y
    y, _ = core.moe(core.ffn_norm(h), segment_ids_BxT=seg,
                    image_mask_BxT=jnp.zeros(seg.shape, bool), bias_2xE=bias[i])
    h = h + y
  want = jnp.einsum("btd,dv->btv", model.final_norm(h), model.head[...],
                    preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))


def test_plain_equals_identity_mhc_on_the_micro_model():
  plain = _micro(residual="plain", hc_mult=1)
  ident = _micro(hc_mult=1, hc_init_fn_std=0.0, hc_eps=0.0)
  g_ident, s_ident = nnx.split(M.Transformer(ident, nnx.Rngs(2)))
  g_plain, s_plain = nnx.split(M.abstract_model(plain))
  shared = {k: v for k, v in nnx.to_flat_state(s_ident)
            if not any(str(c).endswith("_hc") for c in k)}
  s_plain = nnx.from_flat_state({k: shared[k] for k, _ in nnx.to_flat_state(s_plain)})
  tokens = np.random.default_rng(1).integers(0, plain.vocab_size, (2, plain.seq_len))
  bias = M.zero_moe_bias(plain)
  out = {}
  for name, g, s, cfg in (("plain", g_plain, s_plain, plain), ("ident", g_ident, s_ident, ident)):
    out[name] = np.asarray(jax.jit(lambda s, b, g=g: nnx.merge(g, s)(b, bias)[0])(
        s, _batch(cfg, tokens)))
  # Two different programs (XLA fuses and orders their float32 sums differently): measured
  # ≤ 1.7e-6 at |logit| ≤ 4; a sublayer read or added wrongly moves logits by O(1).
  np.testing.assert_allclose(out["plain"], out["ident"], rtol=0, atol=1e-5)


def test_plain_prefill_and_decode_equal_the_forward_pass():
  """Full-depth prefill of 11 tokens, then a decode step at each later position, as in
  tests/dsv41_jax/inference/test_decode.py (tolerance and its reason there: 2e-5 absolute)."""
  from dsv41_jax.inference import Decoder
  cfg = _micro(residual="plain", hc_mult=1)
  model = M.init_model(cfg, 3)
  bias = jax.random.normal(jax.random.key(4), (cfg.num_hidden_layers, 2, cfg.n_routed_experts)) * 0.1
  dec = Decoder(model, bias, stored_formats=False)
  T, N = cfg.seq_len, 11
  tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
  ref = np.asarray(jax.jit(lambda b: model(b, bias)[0])(_batch(cfg, tokens)))[0]
  logits, cache = dec.prefill(tokens[:, :N], T, depth="full")
  got = [np.asarray(logits)[0]]
  for t in range(N, T):
    logits, cache = dec.step(cache, tokens, t)
    got.append(np.asarray(logits)[0])
  np.testing.assert_allclose(np.stack(got), ref[N - 1:], rtol=0, atol=2e-5)


@pytest.mark.parametrize("changes, what", [
    (dict(residual="none"), "residual must be 'mhc' or 'plain'"),
    (dict(residual="plain"), r"hc_mult must be 1 \(got 2\)"),
])
def test_bad_residual_is_named(changes, what):
  with pytest.raises(ConfigError, match=what):
    _micro(**changes)
