"""pallas_kernels/indexer.py (interpret mode) against the op pallas_kernels.ops.indexer (through the model's
`score_and_select`)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import testing
from dsv41_jax.layers import indexer as ix
from dsv41_jax.layers.types import CompressedKV, entry_visible
from pallas_kernels import dispatch
from pallas_kernels import indexer as kx
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls

B, T, H, I, K = 2, 45, 3, 32, 8   # T = 45: no block divides it; K = 8 > entries visible early on
BLOCKS = dict(block_t=16, block_n=16)


def naive_entries(seg, m):
  """(entry segment [B, N], −1 for a group that is partial or crosses documents; entry last row
  [N]) of groups of m rows, by a loop over the groups (independent of the compressor's)."""
  b_, t_ = seg.shape
  N = -(-t_ // m)
  last = (np.arange(N) + 1) * m - 1
  eseg = np.full((b_, N), -1, np.int32)
  for b in range(b_):
    for g in range(N):
      toks = seg[b, g * m:(g + 1) * m]
      if last[g] < t_ and len(set(toks)) == 1 and toks[0] > 0:
        eseg[b, g] = toks[0]
  return eseg, last


def _inputs(seed, m):
  """Random q, w, index keys; ragged documents (row 1 ends in padding) and their entry metadata."""
  rng = np.random.default_rng(seed)
  seg = np.ones((B, T), np.int32)
  seg[0, 17:] = 2
  seg[1, 30:] = 3
  seg[1, 40:] = 0
  eseg, last = naive_entries(seg, m)
  N = len(last)
  kv = CompressedKV(None, jnp.asarray(rng.standard_normal((B, N, I)), jnp.float32),
                    jnp.asarray(eseg), jnp.asarray(np.broadcast_to(last, (B, N))), None)
  q = jnp.asarray(rng.standard_normal((B, T, H, I)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
  return q, w, kv, jnp.asarray(seg)


def _kernel_select(q, w, kv, seg, **kw):
  return kx.score_and_select(q, w, kv.index_k_BxNxI, kv.entry_segment_BxN, kv.entry_last_BxN, seg,
                             k=K, interpret=True, **BLOCKS, **kw)


@pytest.mark.parametrize("m, tiles", [(1, BLOCKS), (2, BLOCKS), (1, {}),
                                      (1, dict(BLOCKS, block_chunk=32)),
                                      (1, dict(BLOCKS, block_chunk=512)),
                                      (1, dict(BLOCKS, block_chunk=8))])
def test_masked_scores_match_reference(m, tiles):
  # tiles {}: the default 64 × 128, one block holding all of T and N; block_chunk 32: two entry
  # blocks a program, N not a multiple of it (padded), later chunks dead for the first rows;
  # block_chunk 512 (score_and_select's default): larger than the row, so the row; block_chunk 8:
  # smaller than an entry block of 16, so one block (a larger block_n under the default chunk)
  q, w, kv, seg = _inputs(m, m)
  got = kx.masked_scores(q, w, kv.index_k_BxNxI, kv.entry_segment_BxN, kv.entry_last_BxN, seg,
                         jnp.arange(T), interpret=True, **tiles)
  vis = np.asarray(entry_visible(kv, seg))
  want = np.asarray(ix.indexer_scores(q, kv.index_k_BxNxI, w))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got)), vis)
  assert np.all(np.asarray(got)[~vis] == -np.inf)
  # float32, HIGHEST dots: per-head accumulation vs one einsum differs only in summation order.
  np.testing.assert_allclose(np.asarray(got)[vis], want[vis], rtol=1e-5, atol=1e-5)


def test_layer_remat_keeps_the_selection_and_its_scores():
  # Under the model's remat policy the backward reads the kept topk and scores_at_topk: neither the
  # scores kernel nor scores_at's forward kernel runs again (each once in the gradient's program).
  from dsv41_jax.model import remat_policy
  q, w, kv, seg = _inputs(3, 1)

  def loss(q, w, k):
    topk, picked = kx.score_and_select(q, w, k, kv.entry_segment_BxN, kv.entry_last_BxN, seg, k=K,
                                       interpret=True, **BLOCKS)
    return jnp.sum(jax.nn.log_softmax(jnp.where(topk >= 0, picked, -1e30)) * 0.5)

  text = str(jax.make_jaxpr(jax.grad(jax.checkpoint(loss, policy=remat_policy), argnums=(0, 1, 2)))(
      q, w, kv.index_k_BxNxI))
  assert text.count("name=masked_scores") == 1
  assert text.count("name=_scores_at_kernel_fwd") == 1
  assert text.count("name=_scores_at_kernel_bwd") == 1


def test_masked_scores_chunk_must_be_whole_entry_blocks():
  q, w, kv, seg = _inputs(1, 1)
  with pytest.raises(ValueError, match="block_chunk 24 is not a multiple of block_n 16"):
    kx.masked_scores(q, w, kv.index_k_BxNxI, kv.entry_segment_BxN, kv.entry_last_BxN, seg,
                     jnp.arange(T), interpret=True, **BLOCKS, block_chunk=24)


@pytest.mark.parametrize("m, row_bytes", [(1, None), (2, 2 * 16 * 23 * 4)])
def test_selection_and_gradient_match_reference(m, row_bytes):
  # row_bytes: I for 16 rows at a time (N = 23), so top-k runs in 3 row chunks, the last ragged.
  q, w, kv, seg = _inputs(10 + m, m)
  kw = {} if row_bytes is None else dict(max_score_bytes=row_bytes)
  topk, picked = _kernel_select(q, w, kv, seg, query_chunk=16, max_slot_bytes=0, **kw)
  rtopk, rpicked, _ = ix.score_and_select(q, w, kv, seg, k=K)
  assert int(jnp.sum(rtopk < 0)) > 0
  np.testing.assert_array_equal(np.asarray(topk) < 0, np.asarray(rtopk) < 0)
  # Same selected sets (continuous random scores: no ties within the 1e-6 rounding differences).
  np.testing.assert_array_equal(np.sort(np.asarray(topk), -1), np.sort(np.asarray(rtopk), -1))
  order = lambda t, s: np.take_along_axis(np.asarray(s), np.argsort(np.asarray(t), -1), -1)
  np.testing.assert_allclose(order(topk, picked), order(rtopk, rpicked), rtol=1e-5, atol=1e-5)

  r = jnp.asarray(np.random.default_rng(m).standard_normal(topk.shape), jnp.float32)

  def grads(fn):
    def f(q, w, k):
      t, s = fn(q, w, kv._replace(index_k_BxNxI=k))
      return jnp.sum(jnp.take_along_axis(s, jnp.argsort(t, -1), -1) * r)
    return jax.grad(f, argnums=(0, 1, 2))(q, w, kv.index_k_BxNxI)

  got = grads(lambda q, w, kv: _kernel_select(q, w, kv, seg, query_chunk=16, max_slot_bytes=0, **kw))
  want = grads(lambda q, w, kv: ix.score_and_select(q, w, kv, seg, k=K)[:2])
  for g, h in zip(got, want):
    assert float(jnp.max(jnp.abs(h))) > 0.1
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-5)


def test_triton_select_gives_the_radix_select_results(monkeypatch):
  # The kernel's two selections (XLA radix passes, one Triton program per row) fill the same
  # slots, so the scores at them are equal too; "auto" (the default) takes the Triton program
  # (stopping its digits early) where it holds a row's entries and the radix passes beyond.
  q, w, kv, seg = _inputs(14, 2)
  want = _kernel_select(q, w, kv, seg, select="radix")
  for select in ("triton", "triton_early"):
    for a, b in zip(_kernel_select(q, w, kv, seg, select=select), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ran = []
  spy = {n: (lambda f, n: lambda *a, **k: ran.append(n) or f(*a, **k))(f, n)
         for n, f in kx._SELECTS.items()}
  monkeypatch.setattr(kx, "_SELECTS", spy)
  N = kv.index_k_BxNxI.shape[1]
  for limit, chosen in ((N, "triton_early"), (N - 1, "radix")):
    monkeypatch.setattr(kx, "_TRITON_MAX_ENTRIES", limit)
    ran.clear()
    for a, b in zip(_kernel_select(q, w, kv, seg), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ran and set(ran) == {chosen}, (limit, ran)
  with pytest.raises(ValueError, match="indexer kernel: select 'sort' is not one of"):
    _kernel_select(q, w, kv, seg, select="sort")


def test_model_switch_and_fallback(caplog):
  # The decision is logged once per process: forget earlier tests' notices (order-independent).
  from pallas_kernels import notices
  notices._NOTED.clear()
  q, w, kv, seg = _inputs(20, 2)
  got = ix.score_and_select(q, w, kv, seg, k=K, policy="kernel")
  want = ix.score_and_select(q, w, kv, seg, k=K)
  assert got[2] is None
  np.testing.assert_array_equal(np.sort(np.asarray(got[0]), -1), np.sort(np.asarray(want[0]), -1))
  # The candidate pool has no Triton kernel: "auto" runs the reference (equal results) and logs
  # once, naming the reason; "kernel" runs the op's second kernel, the radix select (the same
  # sets and pool; tests/pallas_kernels/test_topk_select.py compares it in full).
  pool = dict(k=K, make_pool=True, block_size=4, topk_blocks=2)
  with caplog.at_level(logging.INFO):
    for _ in range(2):
      pooled = ix.score_and_select(q, w, kv, seg, **pool, policy="auto")
  assert sum("runs the reference" in r.message and "candidate pool" in r.message
             for r in caplog.records) == 1
  assert dispatch.choose("indexer_topk", "kernel", q, w, kv.index_k_BxNxI, kv.entry_segment_BxN,
                         kv.entry_last_BxN, seg, None, **pool)[0] == (
      "pallas_kernels.topk_select:score_and_select")
  radix = ix.score_and_select(q, w, kv, seg, **pool, policy="kernel")
  ref = ix.score_and_select(q, w, kv, seg, **pool)
  for a, b in zip(pooled, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.sort(np.asarray(radix[0]), -1), np.sort(np.asarray(ref[0]), -1))
  np.testing.assert_array_equal(np.asarray(radix[2]), np.asarray(ref[2]))


@pytest.mark.parametrize("shape, why", [
    (dict(), None), (dict(K=512), None), (dict(I=64), "index_head_dim 64"),
    (dict(H=32), "32 index heads"), (dict(K=1024), "top-1024"), (dict(T=2048), "2048 tokens")])
def test_auto_takes_the_kernel_on_the_gpu_inside_the_measured_envelope(monkeypatch, shape, why):
  # The shape policy on abstract arguments (a GPU backend pretended): s3's and m3's indexer shapes
  # (16 heads x 128, top-256 / top-512, 4,096 tokens) take the Triton kernel; each shape outside falls back,
  # named in the reason; off the GPU "auto" runs the reference.
  s = {**dict(T=4096, H=16, I=128, K=256), **shape}
  sd = lambda *a, dt=jnp.bfloat16: jax.ShapeDtypeStruct(a, dt)
  n = s["T"] // 4
  args = (sd(4, s["T"], s["H"], s["I"]), sd(4, s["T"], s["H"], dt=jnp.float32),
          sd(4, n, s["I"]), sd(4, n, dt=jnp.int32), sd(4, n, dt=jnp.int32),
          sd(4, s["T"], dt=jnp.int32), None)
  assert dispatch.choose("indexer_topk", "auto", *args, k=s["K"])[0] == (
      "pallas_kernels.ops.indexer:score_and_select")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  path, _ = dispatch.choose("indexer_topk", "auto", *args, k=s["K"])
  if why is None:
    assert path == "pallas_kernels.indexer:indexer_topk"
  else:
    assert path == "pallas_kernels.ops.indexer:score_and_select"
    assert why in dispatch.OPS["indexer_topk"].kernels[0].faster(args, dict(k=s["K"]))


def test_lowers_for_cuda():
  # Triton lowering on the CPU host for CUDA (cuda_lowering): catches what interpret mode cannot,
  # e.g. a loop carry the lowering rejects (seen on the H200 before the fix).
  q, w, kv, seg = _inputs(30, 2)
  q, k = q.astype(jnp.bfloat16), kv.index_k_BxNxI.astype(jnp.bfloat16)
  r = jnp.ones((B, T, K), jnp.float32)
  sel = lambda q, w, k: kx.score_and_select(q, w, k, kv.entry_segment_BxN, kv.entry_last_BxN, seg,
                                            k=K, interpret=False)[1]
  fwd = lower_for_cuda(lambda q, w, k: jnp.sum(sel(q, w, k) * r), q, w, k)
  lowered = lower_for_cuda(jax.grad(lambda q, w, k: jnp.sum(sel(q, w, k) * r), argnums=(0, 1, 2)),
                           q, w, k)
  # Forward: the scores kernel and the selected entries' scores. Gradient: the scores kernel (the
  # selection), the scores_at backward and its entry sums (the keys' gradient); no XLA fallback.
  assert triton_calls(fwd) == 2 and 'name = "indexer_at_topk"' in fwd.as_text()
  assert triton_calls(lowered) == 3
  assert all(f'name = "{n}"' in lowered.as_text()
             for n in ("indexer_scores", "indexer_at_topk_bwd", "csa2_entry_sums"))
  chunked = lower_for_cuda(lambda q, w, k: kx.masked_scores(
      q, w, k, kv.entry_segment_BxN, kv.entry_last_BxN, seg, jnp.arange(T), block_t=16,
      block_n=16, block_chunk=32), q, w, k)
  assert triton_calls(chunked) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scores_at_kernels_equal_the_xla_form(dtype):
  # The Triton scores_at (forward and VJP) against its XLA form on the same inputs: 16 heads,
  # K = 40 slots in chunks of 16 (the last ragged), −1 slots, entries named by several slots of a
  # row and by many rows. bf16: the same bf16 rounding of a and of the slot contributions, so dq
  # and dk agree bit for bit here. Otherwise every float32 sum runs in another order (~1 ulp of
  # values up to ~10).
  rng = np.random.default_rng(7)
  b, t, h, i, n, k = 2, 9, 16, 32, 13, 40
  q = jnp.asarray(rng.standard_normal((b, t, h, i)), dtype)
  w = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((b, n, i)), dtype)
  topk = jnp.asarray(rng.integers(-1, n, (b, t, k)), jnp.int32)
  r = jnp.asarray(rng.standard_normal((b, t, k)), jnp.float32)

  def run(fn):
    loss = lambda q, w, keys: jnp.sum(fn(q, w, keys) * r)
    return fn(q, w, keys), jax.grad(loss, argnums=(0, 1, 2))(q, w, keys)

  got = run(lambda q, w, keys: kx.scores_at(q, w, keys, topk, True, 16))
  want = run(lambda q, w, keys: kx.scores_at_xla(q, w, keys, topk, True))
  assert np.all(np.asarray(got[0])[np.asarray(topk) < 0] == 0)
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32),
                                                  np.asarray(b, np.float32), rtol=1e-6, atol=2e-6)
  close(got[0], want[0])
  for j, (g, h_) in enumerate(zip(got[1], want[1])):
    assert g.dtype == h_.dtype and float(jnp.max(jnp.abs(h_.astype(jnp.float32)))) > 0.1
    if dtype == jnp.bfloat16 and j != 1:
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h_, np.float32))
    else:
      close(g, h_)


def test_scores_at_chunks_keep_triton_offsets_below_2_31():
  # One row of 65,536 queries, top-512, query_chunk None: a single chunk's slot gradients
  # [1, 65536, 512, 128] would be 2^32 elements; score_and_select takes fewer rows per chunk.
  b, t, h, i, k = 1, 65536, 4, 128, 512
  n = t // 4
  spec = lambda *s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d)
  fn = lambda q, w, keys, eseg, last, seg: kx.score_and_select(
      q, w, keys, eseg, last, seg, k=k, query_chunk=None, interpret=False)
  jaxpr = jax.make_jaxpr(fn)(spec(b, t, h, i), spec(b, t, h, d=jnp.float32), spec(b, n, i),
                             spec(b, n, d=jnp.int32), spec(b, n, d=jnp.int32),
                             spec(b, t, d=jnp.int32))

  shapes = [e.outvars[0].aval.shape for e in testing.jaxpr_eqns(
      jaxpr, "pallas_call", lambda e: "indexer_at_topk" in str(e.params))]
  assert shapes and all(s[0] * s[1] * s[2] * i < 2 ** 31 and s[1] < t for s in shapes), shapes


@pytest.mark.parametrize("max_slot_bytes, rows", [(1 << 31, 4096), (0, 512), (700 << 20, 2048)])
def test_scores_at_chunks_grow_to_the_slot_bytes(max_slot_bytes, rows):
  # s3's shapes (4 x 4096, top-256, I 128, bfloat16; query_chunk 512): the slot gradients of the
  # whole row are 4·4096·320·128·2 B = 1.34 GB, so under the default 2 GiB one chunk; with no room
  # the 512-row chunks; with 700 MiB equal chunks of 2048 rows (not 2,240 + a padded rest).
  b, t, h, i, k = 4, 4096, 4, 128, 256
  n = t // 2
  spec = lambda *s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d)
  fn = lambda q, w, keys, eseg, last, seg: kx.score_and_select(
      q, w, keys, eseg, last, seg, k=k, query_chunk=512, max_slot_bytes=max_slot_bytes,
      interpret=False)
  jaxpr = jax.make_jaxpr(fn)(spec(b, t, h, i), spec(b, t, h, d=jnp.float32), spec(b, n, i),
                             spec(b, n, d=jnp.int32), spec(b, n, d=jnp.int32),
                             spec(b, t, d=jnp.int32))
  shapes = [e.outvars[0].aval.shape for e in testing.jaxpr_eqns(
      jaxpr, "pallas_call", lambda e: "indexer_at_topk" in str(e.params))]
  assert shapes and all(s[1] == rows for s in shapes), shapes

