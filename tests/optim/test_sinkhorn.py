"""Sinkhorn-balanced momentum (optim/sinkhorn.py) against a float64 numpy reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv41_jax import testing

from optim import sinkhorn
from optim.chain import build_optimizer
from optim.config import OptimConfig
from optim.table import Row, TableError
from tests.optim import refs

K, TAU, EPS = 11, 1e-3, 1e-20
TABLE = (Row("emb", "sinkhorn"), Row("tab", "sinkhorn", lr_mult=5.0), Row("s", "adamw"))


def _cfg(**kw):
  base = dict(lr=0.01, warmup_steps=0, decay_start=1000, decay_end=2000, schedule_unit="steps",
              clip_norm=0.0)
  base.update(kw)
  return OptimConfig(**base)


def _skewed(rng, shape):
  """Random matrices with rows and columns on very different scales."""
  return (rng.standard_normal(shape) * rng.uniform(0.05, 20, shape[:-1] + (1,))
          * rng.uniform(0.05, 20, shape[:-2] + (1, shape[-1])))


def test_balance_matches_reference_and_balances_rows_and_columns():
  rng = np.random.default_rng(0)
  x = _skewed(rng, (3, 120, 40))
  x[0, 5] *= 1e-6   # below the relative floor: must stay small, not be blown up
  out = np.asarray(sinkhorn.sinkhorn_balance(jnp.asarray(x, jnp.float32), K, TAU, EPS), np.float64)
  ref = refs.sinkhorn(x.astype(np.float32), K, TAU, EPS)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-9)
  # The starved row ends near ρ/τ of a typical (unit) row, ρ its input RMS relative to the mean.
  r_in = np.sqrt(np.mean(x[0] ** 2, axis=1))
  rho = r_in[5] / r_in.mean()
  row5 = np.sqrt(np.mean(out[0, 5] ** 2))
  assert 0.5 * rho / TAU < row5 < 2 * rho / TAU, (row5, rho / TAU)
  for b in range(3):
    keep = np.ones(120, bool)
    if b == 0:
      keep[5] = False
    r = np.sqrt(np.mean(out[b][keep] ** 2, axis=1))
    assert np.all(np.abs(r / r.mean() - 1) < 0.01), np.abs(r / r.mean() - 1).max()
    if b == 0:
      continue  # the starved row's share of each column is removed with it: columns move by ~1/R
    c = np.sqrt(np.mean(out[b] ** 2, axis=0))
    assert np.all(np.abs(c / c.mean() - 1) < 0.01), np.abs(c / c.mean() - 1).max()


def test_sparse_rows_are_amplified_by_inverse_sqrt_fraction():
  rng = np.random.default_rng(1)
  x = np.zeros((256, 32))
  touched = rng.choice(256, 16, replace=False)   # fraction 1/16
  x[touched] = rng.standard_normal((16, 32))
  out = np.asarray(sinkhorn.sinkhorn_balance(jnp.asarray(x, jnp.float32), K, TAU, EPS))
  untouched = np.setdiff1d(np.arange(256), touched)
  assert np.all(out[untouched] == 0)
  r = np.sqrt(np.mean(out[touched] ** 2, axis=1))
  np.testing.assert_allclose(r, np.sqrt(256 / 16), rtol=0.01)


def test_chain_update_matches_reference_zero_rows_stay_zero_and_rms():
  rng = np.random.default_rng(2)
  cfg = _cfg(lr=0.03)
  params = {"emb": jnp.asarray(rng.standard_normal((2, 48, 16)), jnp.float32),
            "tab": jnp.asarray(rng.standard_normal((64, 8)), jnp.float32),
            "s": jnp.asarray(rng.standard_normal((4,)), jnp.float32)}
  tx = build_optimizer(cfg, params, TABLE)
  state = tx.init(params)
  grads = []
  for _ in range(2):
    g = {k: _skewed(rng, v.shape) if v.ndim > 1 else rng.standard_normal(v.shape)
         for k, v in params.items()}
    g["tab"][::3] = 0.0   # Engram rows no token hit, in both steps
    grads.append({k: jnp.asarray(v, jnp.float32) for k, v in g.items()})
  _, state = tx.update(grads[0], state, params)
  u, _ = tx.update(grads[1], state, params)
  beta = cfg.sinkhorn_momentum
  for name, mult in (("emb", 1.0), ("tab", 5.0)):
    g1, g2 = (np.asarray(g[name], np.float64) for g in grads)
    d = g2 + beta * (beta * g1 + g2)
    ref = -cfg.lr * mult * refs.rescale(refs.sinkhorn(d, K, TAU, EPS), 0.18)
    np.testing.assert_allclose(np.asarray(u[name]), ref, rtol=2e-5, atol=1e-9)
    per_matrix = np.asarray(u[name], np.float64).reshape((-1,) + u[name].shape[-2:])
    for mat in per_matrix:
      assert refs.rms(mat) == pytest.approx(0.18 * cfg.lr * mult, rel=1e-5)
  assert np.all(np.asarray(u["tab"])[::3] == 0.0)
  momentum = [v for p, v in jax.tree_util.tree_flatten_with_path(state)[0]
              if "sinkhorn" in jax.tree_util.keystr(p) and jax.tree_util.keystr(p).endswith("['tab']")]
  assert len(momentum) == 1
  assert np.all(np.asarray(momentum[0])[::3] == 0)


# (offset, rows) of three prime-sized sub-tables, then padding rows that belong to none.
BLOCKS = ((0, 17), (17, 29), (46, 11))
ROWS = 64


def test_sub_tables_are_balanced_separately_and_padding_is_excluded():
  rng = np.random.default_rng(3)
  d = _skewed(rng, (ROWS, 12))
  d[5:17] *= 30.0          # one sub-table far larger than the others
  d[20] *= 1e-6            # a starved row of the second sub-table
  d[60:] = rng.standard_normal((4, 12))   # padding rows: must not enter any statistic
  out = np.asarray(sinkhorn.sinkhorn_direction(jnp.asarray(d, jnp.float32), K, TAU, EPS, 0.18,
                                               BLOCKS), np.float64)
  ref = refs.sinkhorn_sub_tables(d.astype(np.float32), BLOCKS, K, TAU, EPS, 0.18)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-9)
  assert np.all(out[57:] == 0)
  for o, n in BLOCKS:
    assert refs.rms(out[o:o + n]) == pytest.approx(0.18, rel=1e-5)


def test_chain_balances_sub_tables_given_by_path():
  rng = np.random.default_rng(4)
  cfg = _cfg(lr=0.02)
  params = {"emb": jnp.asarray(rng.standard_normal((48, 16)), jnp.float32),
            "tab": jnp.asarray(rng.standard_normal((ROWS, 8)), jnp.float32),
            "s": jnp.asarray(rng.standard_normal((4,)), jnp.float32)}
  tx = build_optimizer(cfg, params, TABLE, sub_tables={"tab": BLOCKS})
  g = {k: jnp.asarray(_skewed(rng, v.shape) if v.ndim > 1 else rng.standard_normal(v.shape),
                      jnp.float32) for k, v in params.items()}
  u, _ = tx.update(g, tx.init(params), params)
  d = np.asarray(g["tab"], np.float64) * (1 + cfg.sinkhorn_momentum)   # first step: g + β·g
  ref = -cfg.lr * 5.0 * refs.sinkhorn_sub_tables(d, BLOCKS, K, TAU, EPS, 0.18)
  np.testing.assert_allclose(np.asarray(u["tab"]), ref, rtol=2e-5, atol=1e-10)
  # a parameter without a layout is still one matrix
  ref_emb = -cfg.lr * refs.rescale(refs.sinkhorn(
      np.asarray(g["emb"], np.float64) * (1 + cfg.sinkhorn_momentum), K, TAU, EPS), 0.18)
  np.testing.assert_allclose(np.asarray(u["emb"]), ref_emb, rtol=2e-5, atol=1e-10)


def test_engram_tables_need_a_layout_and_one_block_balances_a_table_whole():
  """Omitting an Engram table's layout is an error naming it (the Muon chain; AdamW balances
  nothing); the explicit whole-table layout ((0, rows),) equals the one-matrix reference."""
  rng = np.random.default_rng(5)
  table = (Row("emb", "sinkhorn"), Row("**/engram/table", "sinkhorn", lr_mult=5.0),
           Row("s", "adamw"))
  path = "runs/0/engram/table"
  params = {"emb": jnp.asarray(rng.standard_normal((48, 16)), jnp.float32),
            "runs": {"0": {"engram": {"table": jnp.asarray(rng.standard_normal((ROWS, 8)),
                                                           jnp.float32)}}},
            "s": jnp.asarray(rng.standard_normal((4,)), jnp.float32)}
  with pytest.raises(TableError, match=r"sub_tables gives no layout for the Engram tables "
                                       r"\['runs/0/engram/table'\]"):
    build_optimizer(_cfg(), params, table)
  build_optimizer(_cfg(chain="adamw"), params, table)
  cfg = _cfg(lr=0.02)
  tx = build_optimizer(cfg, params, table, sub_tables={path: ((0, ROWS),)})
  g = jax.tree.map(lambda v: jnp.asarray(_skewed(rng, v.shape) if v.ndim > 1
                                         else rng.standard_normal(v.shape), jnp.float32), params)
  u, _ = tx.update(g, tx.init(params), params)
  d = np.asarray(g["runs"]["0"]["engram"]["table"], np.float64) * (1 + cfg.sinkhorn_momentum)
  ref = -cfg.lr * 5.0 * refs.rescale(refs.sinkhorn(d, K, TAU, EPS), 0.18)
  np.testing.assert_allclose(np.asarray(u["runs"]["0"]["engram"]["table"]), ref, rtol=2e-5,
                             atol=1e-10)


@pytest.mark.parametrize("sub_tables, what", [
    ({"nope": BLOCKS}, "no such parameter"),
    ({"s": BLOCKS}, "only sinkhorn"),
    ({"tab": ((0, 17), (10, 29))}, "not ascending"),
    ({"tab": ((0, 17), (17, 50))}, "within 64 rows"),
])
def test_bad_sub_tables_are_named(sub_tables, what):
  params = {"emb": jnp.zeros((4, 4)), "tab": jnp.zeros((ROWS, 8)), "s": jnp.zeros((4,))}
  with pytest.raises(TableError, match=what):
    build_optimizer(_cfg(), params, TABLE, sub_tables=sub_tables)


def _zero_starved_padded(rng):
  """A table of three sub-tables with a starved row, zero rows, a zero column within one
  sub-table, and padding rows filled with noise (which must enter no statistic)."""
  d = _skewed(rng, (ROWS, 12))
  d[20] *= 1e-6            # starved row of the second sub-table
  d[[3, 30, 47]] = 0.0     # zero rows in each sub-table
  d[46:57, 4] = 0.0        # a zero column of the third sub-table only
  d[60:] = rng.standard_normal((4, 12))
  return d


def test_diagonal_form_matches_float64_restatement_with_starved_zero_and_padding_rows():
  rng = np.random.default_rng(6)
  d = np.stack([_zero_starved_padded(rng) for _ in range(2)])   # a leading batch axis
  out = np.asarray(jax.jit(lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18, BLOCKS))(
      jnp.asarray(d, jnp.float32)), np.float64)
  ref = refs.sinkhorn_sub_tables(d.astype(np.float32), BLOCKS, K, TAU, EPS, 0.18)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-9)
  assert np.all(out[:, [3, 30, 47]] == 0) and np.all(out[:, 57:] == 0)
  assert np.all(out[:, 46:57, 4] == 0)
  assert np.all(np.delete(out[:, :46, 4], [3, 30], axis=1) != 0)
  # tiny and huge inputs balance alike (the power-of-two prescale; the balancing is scale-free)
  for scale in (2.0 ** -60, 2.0 ** 60):
    scaled = np.asarray(sinkhorn.sinkhorn_direction(jnp.asarray(d * scale, jnp.float32), K, TAU,
                                                    EPS, 0.18, BLOCKS), np.float64)
    np.testing.assert_allclose(scaled, ref, rtol=2e-5, atol=1e-9)


def test_row_sharded_table_equals_unsharded_with_no_table_sized_collective():
  """The table's rows over 4 devices (the `engram_rows` axes): the same update, and the only
  collectives are of block statistics ([blocks, cols]), never of the table."""
  mesh = testing.cpu_mesh({"engram": 4})
  rng = np.random.default_rng(7)
  d = _zero_starved_padded(rng).astype(np.float32)
  rows = NamedSharding(mesh, P("engram", None))
  f = jax.jit(lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18, BLOCKS),
              in_shardings=rows, out_shardings=rows)
  out = f(jax.device_put(d, rows))
  ref = jax.jit(lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18, BLOCKS))(d)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-12)
  _assert_only_block_statistics_collected(f.lower(jax.device_put(d, rows)).compile().as_text(),
                                          len(BLOCKS), d.shape[1], d.size // 4)


def _assert_only_block_statistics_collected(hlo, n_blocks, cols, table_elems):
  collectives = re.findall(r"= f32\[([\d,]*)\][^=]*? (all-gather|all-reduce|collective-permute|"
                           r"all-to-all|reduce-scatter)\(", hlo)
  assert collectives, "expected the block statistics' all-reduce"
  for dims, op in collectives:
    elems = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
    assert elems <= n_blocks * cols < table_elems, (op, dims)


# A table as the model lays them out: 1024 · 9 rows (split evenly over any power-of-two row group
# up to 1024), three sub-tables and 116 padding rows, so the block sums run by chunks of 9 rows.
BIG_BLOCKS = ((0, 3001), (3001, 4099), (7100, 2000))
BIG_ROWS = 9216


def _big_table(rng):
  """Skewed rows and columns, a starved row, a zero row per sub-table, a zero column within the
  third sub-table, noise in the padding rows."""
  d = _skewed(rng, (BIG_ROWS, 12))
  d[3100] *= 1e-6
  d[[5, 3005, 9000]] = 0.0
  d[7100:9100, 4] = 0.0
  d[9100:] = rng.standard_normal((116, 12))
  return d


def test_chunked_block_sums_match_float64_restatement_and_row_sharding():
  """The chunked block sums (chunks of 9 rows straddling sub-table starts): the direction equals
  the float64 restatement, zero rows, the zero column and the padding stay zero, and over 4 row
  shards it is the same, with no table-sized collective."""
  assert sinkhorn._Blocks(BIG_ROWS, BIG_BLOCKS).chunk == 9
  rng = np.random.default_rng(9)
  d = _big_table(rng).astype(np.float32)
  fn = lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18, BIG_BLOCKS)
  out = np.asarray(jax.jit(fn)(d), np.float64)
  ref = refs.sinkhorn_sub_tables(d, BIG_BLOCKS, K, TAU, EPS, 0.18)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-9)
  assert np.all(out[[5, 3005, 9000]] == 0) and np.all(out[9100:] == 0)
  assert np.all(out[7100:9100, 4] == 0) and np.all(np.delete(out[:7100, 4], [5, 3005]) != 0)
  mesh = testing.cpu_mesh({"engram": 4})
  rows = NamedSharding(mesh, P("engram", None))
  f = jax.jit(fn, in_shardings=rows, out_shardings=rows)
  np.testing.assert_allclose(np.asarray(f(jax.device_put(d, rows))), out, rtol=1e-6, atol=1e-12)
  _assert_only_block_statistics_collected(f.lower(jax.device_put(d, rows)).compile().as_text(),
                                          len(BIG_BLOCKS), d.shape[1], d.size // 4)


def test_lowered_optimizer_update_has_no_scatter():
  """The whole chain (Muon, AdamW, Sinkhorn over sub-tables) lowers without a scatter, which on
  GPU serializes into atomics (issue: 550 ms of a 1.7 s step)."""
  rng = np.random.default_rng(8)
  params = {"emb": jnp.asarray(rng.standard_normal((48, 16)), jnp.float32),
            "tab": jnp.asarray(rng.standard_normal((ROWS, 8)), jnp.float32),
            "s": jnp.asarray(rng.standard_normal((4,)), jnp.float32)}
  tx = build_optimizer(_cfg(), params, TABLE, sub_tables={"tab": BLOCKS})
  text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  assert "sinkhorn" in text or "while" in text   # the lowered program is the real update
  assert "scatter" not in text


def test_block_sums_stream_the_table_into_chunk_partials():
  """A column step's per-sub-table sums reduce the table once to per-chunk partials ([rows/9, 2,
  cols]) and contract those with a small one-hot: the lowered direction holds no float [rows,
  sub-tables] array, the one-hot matmul's operand that was rewritten at every column step (which
  stays only for tables no chunk size fits, like the 64-row one above)."""
  lower = lambda rows, blocks: jax.jit(
      lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18, blocks)).lower(
      jax.ShapeDtypeStruct((rows, 12), jnp.float32)).as_text()
  text = lower(BIG_ROWS, BIG_BLOCKS)
  assert f"tensor<{BIG_ROWS}x{len(BIG_BLOCKS)}xf32>" not in text
  assert f"tensor<{BIG_ROWS // 9}x2x12xf32>" in text
  assert sinkhorn._Blocks(ROWS, BLOCKS).chunk is None
  assert f"tensor<{ROWS}x{len(BLOCKS)}xf32>" in lower(ROWS, BLOCKS)


def test_tables_no_small_chunk_fits_take_a_larger_divisor_not_the_one_hot_product():
  """A table of 1024 · 67 rows (67 prime; m3's Engram table 0 is 1024 · 4,691): the block sums run
  by chunks of 67 rows (the longest divisor of rows / 1024 that fits the smallest block), not the
  one-hot product over every row (which XLA split and padded inside the loop on the GPU), and the
  direction equals the float64 restatement with zero rows and the padding zero; a table whose
  per-group rows have no divisor of at least 8 that fits its smallest block keeps the one-hot
  form."""
  rows, blocks = 1024 * 67, ((0, 20011), (20011, 30011), (50022, 18000))
  blk = sinkhorn._Blocks(rows, blocks)
  assert blk.chunk == 67
  assert sinkhorn._Blocks(1024 * 67, ((0, 66), (66, 60000))).chunk is None   # 67 > 66 rows
  rng = np.random.default_rng(11)
  d = _skewed(rng, (rows, 4)).astype(np.float32)
  d[[3, 20011, 60000]] = 0.0
  fn = jax.jit(lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18, blocks))
  text = fn.lower(jax.ShapeDtypeStruct(d.shape, d.dtype)).as_text()
  assert f"tensor<{rows}x{len(blocks)}xf32>" not in text
  assert f"tensor<{rows // 67}x2x4xf32>" in text
  out = np.asarray(fn(d), np.float64)
  ref = refs.sinkhorn_sub_tables(d, blocks, K, TAU, EPS, 0.18)
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-9)
  assert np.all(out[[3, 20011, 60000]] == 0) and np.all(out[68022:] == 0)


def test_bfloat16_statistics_stay_within_the_rounding_bound_and_read_half_the_table():
  """`stat_dtype="bfloat16"`: the squares X₀² stored once in bfloat16 (each within 2⁻⁸ relative,
  so each factor within ~2⁻⁹ and the direction within ~2⁻⁸ of the float64 restatement) on the
  chunked table with starved, zero and padding rows and a zero column, whole and over 4 row
  shards; zeros stay exactly zero; the loop reads a bfloat16 table, no float32 one; the chain
  passes the config's choice, and a bad name is refused when the chain is built."""
  rng = np.random.default_rng(12)
  d = _big_table(rng).astype(np.float32)
  fn = lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18, BIG_BLOCKS, "bfloat16")
  out = np.asarray(jax.jit(fn)(d), np.float64)
  ref = refs.sinkhorn_sub_tables(d, BIG_BLOCKS, K, TAU, EPS, 0.18)
  np.testing.assert_allclose(out, ref, rtol=2.0 ** -8, atol=0)
  f32 = np.asarray(jax.jit(lambda x: sinkhorn.sinkhorn_direction(x, K, TAU, EPS, 0.18,
                                                                 BIG_BLOCKS))(d), np.float64)
  assert not np.array_equal(out, f32)     # the switch is on: bfloat16 squares move the factors
  assert np.all(out[[5, 3005, 9000]] == 0) and np.all(out[9100:] == 0)
  assert np.all(out[7100:9100, 4] == 0) and np.all(np.delete(out[:7100, 4], [5, 3005]) != 0)
  x = _skewed(rng, (3, 120, 40))
  x[0, 5] *= 1e-6
  np.testing.assert_allclose(
      np.asarray(sinkhorn.sinkhorn_balance(jnp.asarray(x, jnp.float32), K, TAU, EPS,
                                           stat_dtype="bfloat16"), np.float64),
      refs.sinkhorn(x.astype(np.float32), K, TAU, EPS), rtol=2.0 ** -8, atol=0)
  mesh = testing.cpu_mesh({"engram": 4})
  rows = NamedSharding(mesh, P("engram", None))
  f = jax.jit(fn, in_shardings=rows, out_shardings=rows)
  np.testing.assert_allclose(np.asarray(f(jax.device_put(d, rows))), out, rtol=1e-6, atol=1e-12)
  # The loop's invariant table is bfloat16 (the statistics' reads), the float32 one is read after.
  text = jax.jit(fn).lower(jax.ShapeDtypeStruct(d.shape, d.dtype)).as_text()
  loop = text[text.index("stablehlo.while"):]
  assert f"tensor<{BIG_ROWS}x12xbf16>" in loop
  # Through the chain, from the config.
  params = {"tab": jnp.asarray(d)}

  def chain_update(stat_dtype):
    tx = build_optimizer(_cfg(sinkhorn_stat_dtype=stat_dtype), params, (Row("tab", "sinkhorn"),),
                         sub_tables={"tab": BIG_BLOCKS})
    return np.asarray(tx.update(params, tx.init(params), params)[0]["tab"], np.float64)

  f32_update, bf16_update = chain_update("float32"), chain_update("bfloat16")
  assert not np.array_equal(bf16_update, f32_update)
  np.testing.assert_allclose(bf16_update, f32_update, rtol=2.0 ** -8, atol=0)
  with pytest.raises(Exception, match="sinkhorn_stat_dtype"):
    _cfg(sinkhorn_stat_dtype="float16")
  with pytest.raises(ValueError, match="stat_dtype 'fp8'"):
    sinkhorn.scale_by_sinkhorn(0.9, K, TAU, EPS, 0.18, stat_dtype="fp8")
