"""dsv41_jax/layers/compressor.py against float64 loops of docs/design.md §5.2 and §14."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common, tiny
from dsv41_jax import quant
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.layers import compressor as comp_lib
from dsv41_jax.layers.rope import layer_inv_freq
from dsv41_jax.layers.types import CompressedKV, entry_visible

# Two packed rows: row 0 holds documents 1 (5 tokens), 2 (6 tokens) and 3 (2 tokens); row 1 holds
# document 1 (8 tokens) then padding (segment 0). T = 13 is odd, so m = 2 leaves a partial group.
SEG = np.array([[1] * 5 + [2] * 6 + [3] * 2, [1] * 8 + [0] * 5], np.int32)
POS = np.array([list(range(5)) + list(range(6)) + list(range(2)), list(range(8)) + [0] * 5],
               np.int32)


def _cfg(**kw):
  return common.model_config(tiny.get_config()).replace(**kw)


def np_compress(x, wkv, wgate, m):
  """§5.2 literally: per group, per channel softmax over the group's tokens (float64)."""
  x, wkv = x.astype(np.float64), wkv.astype(np.float64)
  b, t, _ = x.shape
  n = -(-t // m)
  out = np.zeros((b, n, wkv.shape[1]))
  for bi in range(b):
    for g in range(n):
      rows = [j for j in range(g * m, (g + 1) * m)]
      xs = np.stack([x[bi, j] if j < t else np.zeros(x.shape[-1]) for j in rows])
      c = xs @ wkv
      if m == 1:
        out[bi, g] = c[0]
        continue
      z = xs @ wgate.astype(np.float64)
      e = np.exp(z - z.max(0))
      out[bi, g] = (e / e.sum(0) * c).sum(0)
  return out


def np_rope(x, pos, inv):
  x = x.astype(np.float64).copy()
  r = 2 * len(inv)
  for idx in np.ndindex(*x.shape[:-1]):
    p = pos[idx[:pos.ndim]]
    for i, w in enumerate(inv):
      lo = x.shape[-1] - r + 2 * i
      a, b = x[idx + (lo,)], x[idx + (lo + 1,)]
      x[idx + (lo,)] = a * np.cos(p * w) - b * np.sin(p * w)
      x[idx + (lo + 1,)] = a * np.sin(p * w) + b * np.cos(p * w)
  return x


def np_rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def np_metadata(seg, pos, m):
  b, t = seg.shape
  n = -(-t // m)
  es, el, ep = (np.zeros((b, n), np.int64) for _ in range(3))
  for bi in range(b):
    for g in range(n):
      rows = range(g * m, (g + 1) * m)
      docs = {seg[bi, j] if j < t else 0 for j in rows}
      d = docs.pop()
      es[bi, g] = d if (not docs and d > 0) else -1
      el[bi, g] = (g + 1) * m - 1
      ep[bi, g] = pos[bi, g * m]
  return es, el, ep


@pytest.mark.parametrize("m", [1, 2])
def test_compress_matches_loop(m):
  rng = np.random.default_rng(m)
  x = rng.standard_normal((2, 13, 24)).astype(np.float32)
  wkv = (rng.standard_normal((24, 16)) / 5).astype(np.float32)
  wgate = (rng.standard_normal((24, 16))).astype(np.float32) if m > 1 else None
  got = comp_lib.compress(jnp.asarray(x), jnp.asarray(wkv),
                          None if wgate is None else jnp.asarray(wgate), m)
  assert got.shape == (2, -(-13 // m), 16)
  np.testing.assert_allclose(np.asarray(got), np_compress(x, wkv, wgate, m), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_metadata_and_visibility_match_rules(m):
  es, el, ep = comp_lib.entry_metadata(jnp.asarray(POS), jnp.asarray(SEG), m)
  ref = np_metadata(SEG, POS, m)
  for got, want in zip((es, el, ep), ref):
    np.testing.assert_array_equal(np.asarray(got), want)
  if m == 2:  # the groups straddling a boundary, the partial last group and padding are −1
    np.testing.assert_array_equal(np.asarray(es)[0], [1, 1, -1, 2, 2, -1, -1])
    np.testing.assert_array_equal(np.asarray(es)[1], [1, 1, 1, 1, -1, -1, -1])
  n = es.shape[1]
  kv = CompressedKV(jnp.zeros((2, n, 4)), jnp.zeros((2, n, 4)), es, el, ep)
  vis = np.asarray(entry_visible(kv, jnp.asarray(SEG)))
  b, t = SEG.shape
  for bi in range(b):
    for ti in range(t):
      for g in range(n):
        rows = list(range(g * m, (g + 1) * m))
        want = (SEG[bi, ti] > 0 and rows[-1] <= ti
                and all(j < t and SEG[bi, j] == SEG[bi, ti] for j in rows))
        assert vis[bi, ti, g] == want, (bi, ti, g)


@pytest.mark.parametrize("layer,fp4", [(2, False), (6, False), (2, True)])
def test_compressor_module(layer, fp4):
  """latent = RMSNorm_w(c) pre-RoPE; main_kv = latent rotated at entry_pos (+ FP4 when on)."""
  cfg = _cfg(fp4_main_kv=fp4)
  spec = build_layer_plan(cfg)[layer]
  m = spec.compress_ratio
  mod = comp_lib.Compressor(cfg, spec, nnx.Rngs(layer))
  assert (mod.wgate is None) == (m == 1)
  rng = np.random.default_rng(layer)
  mod.norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.head_dim), jnp.float32)
  x = rng.standard_normal((2, 13, cfg.hidden_size)).astype(np.float32)
  inv = layer_inv_freq(cfg, spec)
  main_kv, latent, es, el, ep = mod(jnp.asarray(x), jnp.asarray(POS), jnp.asarray(SEG), inv)
  c = np_compress(x, np.asarray(mod.wkv[...]),
                  None if mod.wgate is None else np.asarray(mod.wgate[...]), m)
  lat_ref = np_rms(c, np.asarray(mod.norm.scale[...], np.float64), cfg.rms_norm_eps)
  np.testing.assert_allclose(np.asarray(latent), lat_ref, rtol=1e-5, atol=1e-5)
  kv_ref = np_rope(lat_ref, np_metadata(SEG, POS, m)[2], inv)
  if fp4:
    # The quantizer itself is tested in test_quant; here: it is applied after RoPE, blocks of 16.
    mod.fp4 = False
    unq = np.asarray(mod(jnp.asarray(x), jnp.asarray(POS), jnp.asarray(SEG), inv)[0])
    np.testing.assert_allclose(unq, kv_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(main_kv), np.asarray(quant.fp4_main_kv(jnp.asarray(unq))))
    assert not np.allclose(np.asarray(main_kv), unq)
  else:
    np.testing.assert_allclose(np.asarray(main_kv), kv_ref, rtol=1e-5, atol=1e-5)
