"""Whole-stack properties of `dsv41_jax.model` on a micro config with every CSA2 mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import inputs, model as M, sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.loss import objective


def micro_config(**changes) -> ModelConfig:
  """8 layers: SWA+Engram, Full+Engram, Reuse×2 (m=2) | Full, Reindex×3 (m=1, scanned)."""
  base = dict(
      vocab_size=128, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, head_dim=32,
      qk_rope_head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=16, sliding_window=8,
      compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4),
      index_source_layer_ids=(1, 4, 5, 6, 7), index_n_heads=2, index_head_dim=16, index_topk=4,
      yarn_enabled=False, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      engram_layer_ids=(0, 1), engram_n_heads=2, engram_head_dim=8, engram_vocab_size=211,
      engram_compressed_vocab_size=128, seq_len=32, dtype="float32", hc_init_fn_std=0.02,
      # Compile time dominates these tests; rematerialisation is exercised by the training runs.
      remat=False)
  base.update(changes)
  return ModelConfig(**base)


def packed_batch(cfg, rng, boundaries=((13,), ()), pad_from=(None, 27)):
  B, T = len(boundaries), cfg.seq_len
  tokens = rng.integers(0, cfg.vocab_size, (B, T))
  seg = np.ones((B, T), np.int32)
  for b, cuts in enumerate(boundaries):
    for c in cuts:
      seg[b, c:] += 1
    if pad_from[b] is not None:
      seg[b, pad_from[b]:] = 0
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    for t in range(1, T):
      pos[b, t] = 0 if seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
  return tokens, seg, pos


def to_batch(cfg, tokens, seg, pos):
  targets = np.roll(tokens, -1, axis=1)
  loss_mask = (seg > 0) & (np.roll(seg, -1, axis=1) == seg)
  loss_mask[:, -1] = False
  return dict(tokens=jnp.asarray(tokens), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg),
              targets=jnp.asarray(targets), loss_mask=jnp.asarray(loss_mask),
              engram_ids={k: jnp.asarray(v) for k, v in inputs.engram_ids(cfg, tokens, seg).items()})


@pytest.fixture(scope="module")
def cfg():
  return micro_config()


@pytest.fixture(scope="module")
def split_model(cfg):
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
  tokens, seg, pos = packed_batch(cfg, rng)
  base = np.asarray(logits_of(to_batch(cfg, tokens, seg, pos)))
  assert np.isfinite(base).all()

  # 1. Changing tokens after t (t = 20 sits inside an m = 2 group) leaves logits at ≤ t unchanged.
  t = 20
  later = tokens.copy()
  later[:, t + 1:] = rng.integers(0, cfg.vocab_size, later[:, t + 1:].shape)
  out = np.asarray(logits_of(to_batch(cfg, later, seg, pos)))
  np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-5)
  assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max() > 1e-3

  # 2. Changing the first document of row 0 (tokens 0..12) leaves the second document unchanged.
  first = tokens.copy()
  first[0, :13] = rng.integers(0, cfg.vocab_size, 13)
  out = np.asarray(logits_of(to_batch(cfg, first, seg, pos)))
  np.testing.assert_allclose(out[0, 13:], base[0, 13:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[1], base[1], rtol=1e-5, atol=1e-5)
  assert np.abs(out[0, :13] - base[0, :13]).max() > 1e-3


def test_scan_equals_unrolled_and_prefill_stops_at_the_encoder(cfg, split_model):
  graphdef, state = split_model
  bias = M.zero_moe_bias(cfg)
  rng = np.random.default_rng(3)
  batch = to_batch(cfg, *packed_batch(cfg, rng))
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


def test_loss_isolation_and_sharded_equals_single_device(cfg, split_model):
  """The indexer loss trains only indexer parameters and the LM loss never does (MODEL.md §5.5);
  on an 8-device mesh (data 2 × expert 2 × tensor 2) the losses, logits and both gradients equal
  the single-device results.

  Tolerance: sharding only reorders float32 arithmetic, so the sharded run must be as close to a
  float64 run of the same program as the single-device float32 run is: within 4× of the
  single-device error, plus 1e-5 of the leaf's scale (~100 float32 ulps: the float64 program
  keeps the residual streams and the routing in float32 as the model does, so it shares part of
  the single-device rounding). A wrong collective or a missing partial sum is off by O(|g|).
  """
  graphdef, state = split_model
  bias = M.zero_moe_bias(cfg)
  rng = np.random.default_rng(4)
  tokens, seg, pos = packed_batch(cfg, rng, boundaries=((13,), (), (7, 20), ()),
                                  pad_from=(None, 27, None, 30))
  batch = to_batch(cfg, tokens, seg, pos)

  def program(graphdef, cfg):
    def parts(params, batch):
      logits, aux = nnx.merge(graphdef, params)(batch, bias)
      return objective(cfg, logits, aux, batch)[1], logits

    def fn(params, batch):
      p, logits = parts(params, batch)
      g_lm = jax.grad(lambda q: parts(q, batch)[0]["lm_loss"])(params)
      g_idx = jax.grad(lambda q: parts(q, batch)[0]["indexer_loss"])(params)
      return (p["lm_loss"], p["indexer_loss"], logits), (g_lm, g_idx)
    return jax.jit(fn)

  f32 = program(graphdef, cfg)
  vals1, (g_lm, g_idx) = f32(state, batch)

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

  mesh = sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2})
  rows = sharding.logical_to_mesh(("batch",))[0]
  with jax.set_mesh(mesh):
    params = jax.device_put(state, sharding.state_shardings(state, mesh))
    sbatch = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(rows, *([None] * (x.ndim - 1))))), batch)
    vals2, grads2 = program(graphdef, cfg)(params, sbatch)

  with jax.enable_x64(True):
    cfg64 = cfg.replace(dtype="float64", param_dtype="float64")
    g64, _ = nnx.split(nnx.eval_shape(lambda: M.Transformer(cfg64, nnx.Rngs(0))))
    to64 = lambda t: jax.tree.map(
        lambda x: np.asarray(x, np.float64) if np.asarray(x).dtype == np.float32 else x, t)
    vals64, grads64 = program(g64, cfg64)(to64(state), to64(batch))
    vals64, grads64 = jax.tree.map(np.asarray, (vals64, grads64))

  def close(a32, b32, ref, what):
    a32, b32, ref = (np.asarray(x, np.float64) for x in (a32, b32, ref))
    err1, err2 = np.abs(a32 - ref).max(), np.abs(b32 - ref).max()
    assert err2 <= 4.0 * err1 + 1e-5 * max(np.abs(ref).max(), 1e-30), (what, err2, err1)

  for name, a, b, ref in zip(("lm_loss", "indexer_loss", "logits"), vals1, vals2, vals64):
    close(a, b, ref, name)
  for g1, g2, ref in zip((g_lm, g_idx), grads2, grads64):
    for (path, a), b, r in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2),
                               jax.tree.leaves(ref)):
      close(a, b, r, jax.tree_util.keystr(path))
