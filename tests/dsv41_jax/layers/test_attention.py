"""dsv41_jax/layers/attention.py (docs/design.md §4, §14): the Attention module against a float64
restatement; the attention core itself is tested in test_sparse_attention.py."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import quant, sharding
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers.attention import Attention
from dsv41_jax.layers.types import CompressedKV
from tests.pallas_kernels.ops.test_sparse_attention import np_attend, packed_segments, random_topk


# --- independent float64 references ------------------------------------------------------------


def np_rope(x, pos, inv, sign=1.0):
  """Rotate interleaved pairs of the trailing 2·len(inv) channels of x [B, T, ..., C] by pos [B, T].

  The angle pos·ω is rounded to float32 as `apply_rope` forms it (its precision is rope.py's,
  tested there); the rotation itself is float64.
  """
  x = np.array(x, np.float64)
  r = 2 * len(inv)
  ang = sign * (pos.astype(np.float32)[..., None] * np.asarray(inv, np.float32)).astype(np.float64)
  while ang.ndim < x.ndim:
    ang = ang[:, :, None]
  a, b = x[..., -r::2].copy(), x[..., -r + 1::2].copy()
  x[..., -r::2] = a * np.cos(ang) - b * np.sin(ang)
  x[..., -r + 1::2] = a * np.sin(ang) + b * np.cos(ang)
  return x


def np_rms(x, w, eps):
  x = np.asarray(x, np.float64)
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y if w is None else y * np.asarray(w, np.float64)


# --- the Attention module ------------------------------------------------------------------------


def tiny_cfg(**changes):
  """Six layers: SWA, then m = 2 Full + Reuse in the encoder and Full + 2 Reuse in the decoder."""
  return ModelConfig(
      vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, head_dim=32,
      qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=24, sliding_window=8,
      compress_ratios=(0, 2, 2, 2, 2, 2), kv_source_layer_ids=(1, 3),
      index_source_layer_ids=(1, 3), index_n_heads=2, index_head_dim=16, index_topk=8,
      engram_layer_ids=(), seq_len=64, dtype="float32").replace(**changes)


def randomize(att, rng):
  """Non-trivial norm weights and sinks (their inits are 1 and 0)."""
  for norm in (att.q_norm, att.kv_norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  att.attn_sink[...] = jnp.asarray(rng.standard_normal(att.attn_sink.shape), jnp.float32)


def compressed_kv(rng, seg, pos, m, D):
  """A CompressedKV with the metadata of docs/design.md §14 for groups of m tokens, random entries."""
  B, T = seg.shape
  N = T // m
  g_seg = seg[:, :N * m].reshape(B, N, m)
  entry_seg = np.where(np.all(g_seg == g_seg[..., :1], -1) & (g_seg[..., 0] > 0), g_seg[..., 0], -1)
  last = np.broadcast_to(np.arange(N) * m + m - 1, (B, N))
  return CompressedKV(jnp.asarray(rng.standard_normal((B, N, D)), jnp.float32), None,
                      jnp.asarray(entry_seg, jnp.int32), jnp.asarray(last, jnp.int32),
                      jnp.asarray(pos[:, ::m][:, :N], jnp.int32))


@pytest.mark.parametrize("q_head_norm,impl", [(False, "masked"), (True, "gather")])
def test_module_matches_numpy(q_head_norm, impl):
  """The whole layer (§4.1–4.4) against a float64 numpy re-computation, packed rows, global part."""
  cfg = tiny_cfg(q_head_norm=q_head_norm, global_attn_impl=impl)
  spec = build_layer_plan(cfg)[2]  # a Reuse layer at m = 2: window + global entries
  rng = np.random.default_rng(20)
  att = Attention(cfg, spec, nnx.Rngs(21))
  randomize(att, rng)
  B, T = 2, 22
  seg, pos = packed_segments(rng, B, T)
  x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
  kv = compressed_kv(rng, seg, pos, 2, cfg.head_dim)
  topk = random_topk(rng, B, T, cfg.index_topk, T // 2, p_empty=0.2)
  y, c_q, probs = nnx.jit(lambda att, x: att(x, positions_BxT=pos, segment_ids_BxT=seg, kv=kv,
                                             topk_BxTxK=topk))(att, x)

  P = {k: np.asarray(v, np.float64) for k, v in
       dict(wq_a=att.wq_a, wq_b=att.wq_b, wkv=att.wkv, wo_a=att.wo_a, wo_b=att.wo_b,
            qn=att.q_norm.scale, kn=att.kv_norm.scale, sink=att.attn_sink).items()}
  inv, eps = np.asarray(att.inv_freq), cfg.rms_norm_eps
  cq_ref = np_rms(x @ P["wq_a"], P["qn"], eps)
  q = np.einsum("btq,qhd->bthd", cq_ref, P["wq_b"])
  if q_head_norm:
    q = np_rms(q, None, eps)
  q = np_rope(q, pos, inv)
  k = np_rope(np_rms(x @ P["wkv"], P["kn"], eps), pos, inv)
  # The module drops slots naming entries invisible to the query (future, other document).
  t = np.arange(T)[None, :, None]
  ent_seg, ent_last = np.asarray(kv.entry_segment_BxN), np.asarray(kv.entry_last_BxN)
  tk = np.maximum(topk, 0)
  ok = ((topk >= 0) & (np.take_along_axis(ent_last[:, None], tk, -1) <= t)
        & (np.take_along_axis(ent_seg[:, None], tk, -1) == seg[:, :, None]) & (seg[:, :, None] > 0))
  topk_vis = np.where(ok, topk, -1)
  o, probs_ref = np_attend(q, k, seg, P["sink"], cfg.sliding_window, cfg.head_dim ** -0.5,
                           np.asarray(kv.main_kv_BxNxD), topk_vis)
  o = np_rope(o, pos, inv, sign=-1.0)                                      # de-rotate (§4.4)
  G = cfg.o_groups
  u = np.einsum("btgi,gio->btgo", o.reshape(B, T, G, -1), P["wo_a"])
  y_ref = u.reshape(B, T, -1) @ P["wo_b"]

  np.testing.assert_allclose(np.asarray(c_q), cq_ref, rtol=0, atol=3e-6)
  np.testing.assert_allclose(np.asarray(probs), probs_ref, rtol=0, atol=2e-6)
  scale = np.abs(y_ref).max()
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=0, atol=2e-6 * scale)
  assert np.any(ok) and np.any((topk >= 0) & ~ok)  # the test exercises both kinds of slot


def test_module_output_path():
  """§4.4 alone: de-rotation by the query position, block-diagonal wo_a, then wo_b."""
  cfg = tiny_cfg()
  att = Attention(cfg, build_layer_plan(cfg)[0], nnx.Rngs(30))
  rng = np.random.default_rng(31)
  B, T, H, D = 2, 9, cfg.num_attention_heads, cfg.head_dim
  o = rng.standard_normal((B, T, H, D)).astype(np.float32)
  pos = rng.integers(0, 5000, (B, T)).astype(np.int32)
  y = att.output(jnp.asarray(o), jnp.asarray(pos))
  inv = np.asarray(att.inv_freq)
  o_d = np_rope(o, pos, inv, sign=-1.0)
  hpg = cfg.heads_per_group
  wo_a, wo_b = np.asarray(att.wo_a, np.float64), np.asarray(att.wo_b, np.float64)
  u = [np.concatenate([o_d[:, :, g * hpg + i] for i in range(hpg)], -1) @ wo_a[g]
       for g in range(cfg.o_groups)]
  y_ref = np.concatenate(u, -1) @ wo_b
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=0, atol=2e-6 * np.abs(y_ref).max())


def test_module_causal_and_document_local():
  """Changing x after t (and the entries completed after t) leaves y[:t+1] bitwise unchanged;
  changing one document leaves the others bitwise unchanged."""
  cfg = tiny_cfg()
  spec = build_layer_plan(cfg)[2]
  att = Attention(cfg, spec, nnx.Rngs(40))
  rng = np.random.default_rng(41)
  randomize(att, rng)
  B, T, t0 = 1, 40, 23
  seg = np.array([[1] * 17 + [2] * 20 + [0] * 3], np.int32)
  pos = np.concatenate([np.arange(17), np.arange(20), np.zeros(3)])[None].astype(np.int32)
  kv = compressed_kv(rng, seg, pos, 2, cfg.head_dim)
  topk = random_topk(rng, B, T, cfg.index_topk, T // 2, p_empty=0.0)  # includes future entries
  run = nnx.jit(lambda att, x, kv: att(x, positions_BxT=pos, segment_ids_BxT=seg, kv=kv,
                                       topk_BxTxK=topk))
  x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
  y1, _, p1 = run(att, x, kv)

  x2 = x.copy()
  x2[:, t0 + 1:] = rng.standard_normal(x2[:, t0 + 1:].shape)
  future = np.asarray(kv.entry_last_BxN)[0] > t0
  kv2 = kv._replace(main_kv_BxNxD=kv.main_kv_BxNxD.at[:, future].set(
      jnp.asarray(rng.standard_normal((B, future.sum(), cfg.head_dim)), jnp.float32)))
  y2, _, p2 = run(att, x2, kv2)
  np.testing.assert_array_equal(np.asarray(y1)[:, :t0 + 1], np.asarray(y2)[:, :t0 + 1])
  np.testing.assert_array_equal(np.asarray(p1)[:, :t0 + 1], np.asarray(p2)[:, :t0 + 1])
  assert not np.allclose(np.asarray(y1)[:, t0 + 1:37], np.asarray(y2)[:, t0 + 1:37])

  doc1 = seg[0] == 1
  x3 = x.copy()
  x3[:, doc1] = rng.standard_normal(x3[:, doc1].shape)
  ents1 = np.asarray(kv.entry_segment_BxN)[0] == 1
  kv3 = kv._replace(main_kv_BxNxD=kv.main_kv_BxNxD.at[:, ents1].set(
      jnp.asarray(rng.standard_normal((B, ents1.sum(), cfg.head_dim)), jnp.float32)))
  y3, _, p3 = run(att, x3, kv3)
  np.testing.assert_array_equal(np.asarray(y1)[:, ~doc1], np.asarray(y3)[:, ~doc1])
  np.testing.assert_array_equal(np.asarray(p1)[:, ~doc1], np.asarray(p3)[:, ~doc1])


def test_fp8_swa_kv_and_params():
  cfg = tiny_cfg(fp8_swa_kv=True, dtype="bfloat16")
  spec = build_layer_plan(cfg)[0]
  att = Attention(cfg, spec, nnx.Rngs(50))
  rng = np.random.default_rng(51)
  x = jnp.asarray(rng.standard_normal((2, 11, cfg.hidden_size)), jnp.bfloat16)
  pos = jnp.asarray(rng.integers(0, 100, (2, 11)), jnp.int32)
  swa_kv = nnx.jit(lambda a, x: a.swa_kv(x, pos))
  kv = swa_kv(att, x)
  plain = Attention(cfg.replace(fp8_swa_kv=False), spec, nnx.Rngs(50))
  np.testing.assert_array_equal(np.asarray(kv, np.float32),
                                np.asarray(quant.fp8_swa(swa_kv(plain, x)), np.float32))
  # Every block of 32 is an E4M3 value times a power of two.
  blocks = np.asarray(kv, np.float32).reshape(2, 11, -1, 32)
  amax = np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-4)
  scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
  codes = blocks / scale
  np.testing.assert_array_equal(codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), codes)
  y, c_q, probs = nnx.jit(lambda a, x: a(x, positions_BxT=pos,
                                         segment_ids_BxT=jnp.ones((2, 11), jnp.int32)))(att, x)
  assert y.dtype == jnp.bfloat16 and c_q.shape == (2, 11, cfg.q_lora_rank) and probs is None
  assert np.all(np.isfinite(np.asarray(y, np.float32)))
  axes = {"/".join(map(str, p)): sharding.param_axes(v) for p, v in
          nnx.to_flat_state(nnx.state(att, nnx.Param))}
  assert axes == {"wq_a": ("embed", "q_lora"), "q_norm/scale": ("norm",),
                  "wq_b": ("q_lora", "heads", "head_dim"), "wkv": ("embed", "kv"),
                  "kv_norm/scale": ("norm",), "attn_sink": ("heads",),
                  "wo_a": ("o_groups", "o_in", "o_lora"), "wo_b": ("o_cat", "embed")}
  assert att.attn_sink.dtype == jnp.float32 and np.all(np.asarray(att.attn_sink) == 0)
