"""Engram lookup, gate and module (dsv41_jax/engram/lookup.py, dsv41_jax/layers/engram.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import common, tiny
from dsv41_jax import quant, sharding, testing
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram import hashing, lookup
from dsv41_jax.layers import engram as engram_layer


def _tiny():
  return common.model_config(tiny.get_config())


def _gate_reference(x, k, w, eps):
  """float64 numpy, docs/design.md §7.3 written out."""
  x, k, w = (np.asarray(a, np.float64) for a in (x, k, w))
  d = x.shape[-1]
  dot = (np.sum(x * w * k, axis=-1) / np.sqrt(np.mean(x**2, -1) + eps)
         / np.sqrt(np.mean(k**2, -1) + eps) / np.sqrt(d))
  return 1.0 / (1.0 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))


def test_gate_matches_float64_formula():
  rng = np.random.default_rng(0)
  B, T, N, D = 2, 5, 4, 48
  x = rng.normal(size=(B, T, N, D)) * rng.uniform(0.1, 10, size=(B, T, N, 1))
  k = rng.normal(size=(B, T, N, D)) * rng.uniform(0.1, 10, size=(B, T, N, 1))
  w = rng.normal(size=(N, D))
  k[0, 0, 1] = 0.0                        # zero key: dot = 0 exactly, ε keeps rsqrt finite
  x[1, 2, 3] = 0.0
  k[1, 4, 0] = 0.0
  k[1, 4, 0, 7] = 3.0                     # key and query on disjoint dims: dot = 0 exactly
  x[1, 4, 0] = 0.0
  x[1, 4, 0, 3] = -2.0
  x, k, w = (a.astype(np.float32) for a in (x, k, w))
  got = np.asarray(lookup.engram_gate(jnp.asarray(x), jnp.asarray(k), jnp.asarray(w), 1e-20))
  want = _gate_reference(x, k, w, 1e-20)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  assert got[0, 0, 1] == 0.5 and got[1, 2, 3] == 0.5 and got[1, 4, 0] == 0.5


_call = nnx.jit(lambda m, *args: m(*args))


def _module(cfg, rng, layer=1, **kw):
  m = engram_layer.Engram(cfg, layer, rngs=nnx.Rngs(int(rng.integers(1 << 30))), **kw)
  N, D = m.q_w.shape
  m.q_w[...] = jnp.asarray(rng.uniform(0.5, 1.5, size=(N, D)), jnp.float32)
  m.k_w[...] = jnp.asarray(rng.uniform(0.5, 1.5, size=(N, D)), jnp.float32)
  return m


def _inputs(cfg, rng, m, B, T):
  hp = hashing.engram_hash_params(cfg, m.layer_id)
  toks = rng.integers(0, cfg.engram_compressed_vocab_size, size=(B, T))
  seg = np.ones((B, T), np.int32)
  seg[:, T // 2:] = 2
  seg[-1, -2:] = 0                                        # padding
  ids = hashing.engram_hash_ids(toks, seg, None, hp)
  mask = seg > 0                                          # padding closes the gate (§14)
  X = rng.normal(size=(B, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
  return X, ids, mask


def test_module_matches_float64_reference_and_mask_closes_gate():
  cfg = _tiny()
  rng = np.random.default_rng(1)
  m = _module(cfg, rng)
  X, ids, mask = _inputs(cfg, rng, m, 2, 6)
  Y, stats = _call(m, jnp.asarray(X), jnp.asarray(ids), jnp.asarray(mask))

  table = np.asarray(m.table[...], np.float64)
  w_ekv = np.asarray(m.w_ekv[...], np.float64)
  N, D = cfg.hc_mult, cfg.hidden_size
  kv = table[ids].reshape(*ids.shape[:2], -1) @ w_ekv
  k = kv[..., :N * D].reshape(*ids.shape[:2], N, D)
  v = kv[..., N * D:]
  w = np.asarray(m.q_w[...], np.float64) * np.asarray(m.k_w[...], np.float64)
  alpha = _gate_reference(X, k, w, cfg.rms_norm_eps) * mask[..., None]
  want = X + alpha[..., None] * v[:, :, None, :]
  np.testing.assert_allclose(np.asarray(Y), want, rtol=0, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(Y)[~mask], X[~mask])      # closed gate: untouched
  np.testing.assert_allclose(np.asarray(stats["gate_mean"]), alpha[mask].mean(0), rtol=0, atol=1e-6)
  per_row = [len(np.unique(ids[b][mask[b]])) for b in range(ids.shape[0])]
  assert float(stats["rows_touched"]) == pytest.approx(np.mean(per_row), rel=1e-6)
  assert float(stats["rows_touched_frac"]) == pytest.approx(np.mean(per_row) / m.num_rows, rel=1e-6)
  assert hashing.batch_rows_touched(ids, mask) == len(np.unique(ids[mask]))
  # A row of padding only does not count.
  mask2 = mask.copy()
  mask2[0] = False
  _, stats2 = _call(m, jnp.asarray(X), jnp.asarray(ids), jnp.asarray(mask2))
  assert float(stats2["rows_touched"]) == pytest.approx(np.mean(per_row[1:]), rel=1e-6)


def test_module_shapes_axes_and_padding():
  cfg = _tiny()
  m = engram_layer.Engram(cfg, 4, rngs=nnx.Rngs(0))
  hp = hashing.engram_hash_params(cfg, 4)
  H = 3 * cfg.engram_n_heads
  assert m.num_rows == hp.num_rows and m.num_rows_padded % 1024 == 0
  assert 0 <= m.num_rows_padded - m.num_rows < 1024
  assert m.table.shape == (m.num_rows_padded, cfg.engram_head_dim)
  assert m.w_ekv.shape == (H * cfg.engram_head_dim, (cfg.hc_mult + 1) * cfg.hidden_size)
  assert sharding.param_axes(m.table) == ("engram_rows", "engram_dim")
  assert sharding.param_axes(m.w_ekv) == ("engram_in", "engram_out")
  assert sorted(nnx.state(m, nnx.Param).keys()) == ["k_w", "q_w", "table", "w_ekv"]
  np.testing.assert_array_equal(np.asarray(m.q_w[...]), 1.0)


def _hlo_ops(compiled_text):
  return set(re.findall(r"= \S+ ([a-z\-]+)\(", compiled_text))


ROWS = P(("engram", "data"), None)     # the "engram_rows" rule on this mesh: 8 owners


@pytest.mark.parametrize("batch,ids_spec", [
    (8, P(("engram", "data"))),   # batch over the row group: each device asks for its own ids
    (3, P()),                     # batch indivisible: replicated ids, one replica sends gradients
])
def test_sharded_lookup_equals_local_values_and_gradients(batch, ids_spec):
  mesh = testing.cpu_mesh({"engram": 4, "data": 2})
  rng = np.random.default_rng(2)
  R, D = 4096, 8
  table = jnp.asarray(rng.normal(size=(R, D)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, R - 100, size=(batch, 6, 5)), jnp.int32)
  ids = ids.at[0, 0].set(jnp.array([0, 511, 512, 3071, 3072]))     # shard edges
  ids = ids.at[0, 1].set(ids[0, 0])                                  # repeated rows
  cot = jnp.asarray(rng.normal(size=(batch, 6, 5, D)), jnp.float32)

  def fn(t, i):
    out, vjp = jax.vjp(lambda tt: lookup.engram_lookup(tt, i), t)
    return out, vjp(cot)[0]

  # the single-device run against numpy, then the sharded run bitwise against it
  result = testing.assert_sharded_matches(fn, (table, ids), mesh,
                                          in_specs=(ROWS, ids_spec), rtol=0, atol=0)
  want_v, want_g = result.single
  np.testing.assert_array_equal(np.asarray(want_v), np.asarray(table)[np.asarray(ids)])
  g_ref = np.zeros((R, D), np.float32)
  np.add.at(g_ref, np.asarray(ids).reshape(-1), np.asarray(cot).reshape(-1, D))
  np.testing.assert_allclose(np.asarray(want_g), g_ref, rtol=1e-6, atol=1e-6)

  got_g = result.sharded[1]
  hlo = result.compiled.as_text()
  with jax.set_mesh(mesh):
    bf16 = jax.jit(lambda t, i: lookup.engram_lookup(t, i, jnp.bfloat16))(*result.sharded_args)
  np.testing.assert_array_equal(np.asarray(bf16), np.asarray(want_v.astype(jnp.bfloat16)))
  assert got_g.sharding.spec[0] == ("engram", "data")
  ops = _hlo_ops(hlo)
  assert "scatter" in ops and "dot" not in ops and testing.count_collectives(hlo)["all-to-all"] > 0
  # Table rows never leave their owner: no collective carries a table shard ([R/8, D]) or more,
  # except sums whose every replica group is one device (they move nothing).
  for line in hlo.splitlines():
    if re.search(r"all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter", line):
      if not testing.single_device_groups(line):
        assert all(int(r) < R // 8 for r in re.findall(rf"\[(\d+),{D}\]", line)), line


def test_sharded_module_equals_single_device():
  cfg = _tiny()
  rng = np.random.default_rng(3)
  m = _module(cfg, rng)
  X, ids, mask = _inputs(cfg, rng, m, 8, 4)
  cot = jnp.asarray(rng.normal(size=X.shape), jnp.float32)
  graphdef, state = nnx.split(m)

  def loss(st, x, i, mk):
    y, stats = nnx.merge(graphdef, st)(x, i, mk)
    return jnp.sum(y * cot), (y, stats)

  def fn(st, x, i, mk):
    (_, (y, stats)), grads = jax.value_and_grad(loss, has_aux=True)(st, x, i, mk)
    return {"y": y, "gate_mean": stats["gate_mean"], "rows_touched": stats["rows_touched"],
            "grads": grads}

  # Float32 arithmetic of the gate's backward (rsqrt norms, cancellation): measured against a
  # float64 run, the local gradients are off by up to 0.4e-5·max|g| and the sharded ones (other
  # fusion and summation order) by up to 1.4e-5·max|g|; a wrong row, shard or offset is an
  # O(max|g|) error. gate_mean to 1e-7; rows_touched exactly.
  rtol = {"y": 1e-6, "gate_mean": 1e-7, "rows_touched": 0.0, "grads": 0.0}
  atol = {"y": 1e-6, "gate_mean": 1e-7, "rows_touched": 0.0}
  key = lambda path: path.split("'")[1]
  result = testing.assert_sharded_matches(
      fn, (state, X, ids, mask), testing.cpu_mesh({"engram": 4, "data": 2}),
      rtol=lambda path, _: rtol[key(path)],
      atol=lambda path, a: atol.get(key(path), 2e-5 * np.abs(a).max()))
  assert result.sharded_args[0]["table"][...].sharding.spec[0][:2] == ("engram", "data")
  assert result.sharded["y"].sharding.spec[0] == ("data", "engram")
  for name in ("table", "w_ekv", "q_w", "k_w"):
    assert np.abs(np.asarray(result.single["grads"][name][...])).max() > 0, name


def test_fp8_rows_match_quant_format_and_module_reads_them():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(64, 64)) * rng.uniform(1e-3, 1e3, size=(64, 2)).repeat(32, 1),
                  jnp.float32)
  q, scale = jax.jit(lookup.quantize_fp8_rows)(x)
  assert q.dtype == jnp.float8_e4m3fn and scale.shape == (64, 2)
  np.testing.assert_array_equal(np.asarray(jax.jit(lookup.dequantize_fp8_rows)(q, scale)),
                                np.asarray(jax.jit(quant.fp8_swa)(x)))
  with pytest.raises(ValueError, match="multiple of 32"):
    engram_layer.Engram(_tiny(), 1, rngs=nnx.Rngs(0), fp8_table=True)
  cfg = _tiny().replace(engram_head_dim=32)
  m = engram_layer.Engram(cfg, 1, rngs=nnx.Rngs(0), fp8_table=True)
  assert "table" not in nnx.state(m, nnx.Param)          # frozen storage, invisible to optimisers
  ids = jnp.asarray(rng.integers(0, m.num_rows, size=(2, 3, m.num_hash_heads)), jnp.int32)
  rows = np.asarray(nnx.jit(lambda mm, i: mm.rows(i))(m, ids))
  full = np.asarray(jax.jit(lookup.dequantize_fp8_rows)(m.table[...], m.table_scale[...]))
  np.testing.assert_array_equal(rows, full[np.asarray(ids)])
  X = jnp.asarray(rng.normal(size=(2, 3, cfg.hc_mult, cfg.hidden_size)), jnp.float32)
  Y, _ = _call(m, X, ids, jnp.ones((2, 3), bool))
  assert np.isfinite(np.asarray(Y)).all() and not np.array_equal(np.asarray(Y), np.asarray(X))


def test_param_count_flash_and_tiny():
  flash = ModelConfig()
  rows = [lookup.padded_rows(r) for r in (384_006_168, 384_016_682)]
  tables = sum(rows) * 256
  assert engram_layer.engram_table_param_count(flash) == tables
  assert abs(tables - 196.6e9) < 0.05e9
  assert engram_layer.engram_param_count(flash) == tables + 2 * (6144 * 25600 + 2 * 4 * 5120)
  cfg = _tiny()
  total = sum(int(x.size) for l in cfg.engram_layer_ids
              for x in jax.tree.leaves(nnx.state(engram_layer.Engram(cfg, l, rngs=nnx.Rngs(0)),
                                                 nnx.Param)))
  assert engram_layer.engram_param_count(cfg) == total


def test_wrong_number_of_hash_ids_rejected():
  cfg = _tiny()
  m = engram_layer.Engram(cfg, 1, rngs=nnx.Rngs(0))
  X = jnp.ones((1, 2, cfg.hc_mult, cfg.hidden_size))
  with pytest.raises(ValueError, match="hash ids per token"):
    m(X, jnp.zeros((1, 2, m.num_hash_heads + 1), jnp.int32), jnp.ones((1, 2), bool))
