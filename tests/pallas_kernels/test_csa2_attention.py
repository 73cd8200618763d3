"""pallas_kernels/csa2_attention.py (interpret mode) against pallas_kernels.ops.sparse_attention.attend_reference."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import testing
from dsv41_jax.layers.indexer import select_topk
from dsv41_jax.layers.types import CompressedKV, entry_visible
from pallas_kernels import csa2_attention as ca
from pallas_kernels import dispatch, notices
from pallas_kernels.ops import sparse_attention as sa
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls
from tests.pallas_kernels.test_indexer import naive_entries

B, T, H, W, K = 2, 37, 3, 8, 8   # T = 37: no block divides it; K = 8 > entries visible early on


def _inputs(seed, m, D=32, dtype=jnp.float32):
  """Random q/kv/entries/sink, two ragged documents per row (row 1 ends in padding), and a top-k
  from random scores over the visible entries (−1 where fewer than K are visible)."""
  rng = np.random.default_rng(seed)
  seg = np.ones((B, T), np.int32)
  seg[0, 13:] = 2
  seg[1, 22:] = 3
  seg[1, 33:] = 0
  eseg, last = naive_entries(seg, m)
  N = len(last)
  kv = CompressedKV(None, None, jnp.asarray(eseg), jnp.asarray(np.broadcast_to(last, (B, N))),
                    None)
  vis = entry_visible(kv, jnp.asarray(seg))
  topk, _ = select_topk(jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32), vis, K)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return dict(q=f(B, T, H, D), kv=f(B, T, D), seg=jnp.asarray(seg),
              sink=jnp.asarray(rng.standard_normal(H), jnp.float32), g=f(B, N, D), topk=topk)

# Small tiles so that T = 37 and N are off every tile, and contributions capped at 10 tokens per
# piece (B · G · Kp · D = 2 · 1 · 8 · 32 elements per token), so the backward runs 4 pieces.
TILES = dict(block_k=4, block_k_bwd=8, block_kw=8, block_e=4, max_contrib_elems=2 * 8 * 32 * 10)


def _run(fn, x, D=32, **kw):
  return fn(x["q"], x["kv"], x["seg"], x["sink"], global_kv_BxNxD=x["g"], topk_BxTxK=x["topk"],
            window=W, scale=D ** -0.5, **kw)


# The checks of equal bits compare two programs (probabilities fused or apart, other slot orders,
# a slot plan made apart). LLVM's full pipeline emits their float32 expressions alike; the suite's
# optimisation level 0 (tests/conftest.py) does not (1-ulp differences in 15 of 64 gradient
# entries), so the programs they compare compile with the full pipeline.
_FULL_LLVM = dict(xla_backend_optimization_level=3, xla_llvm_disable_expensive_passes=False)


def _run_full(fn, x, D=32, **kw):
  """`_run` as one program compiled with LLVM's full pipeline."""
  def run(q, kv, seg, sink, g, topk):
    return _run(fn, dict(q=q, kv=kv, seg=seg, sink=sink, g=g, topk=topk), D, **kw)
  return jax.jit(run, compiler_options=_FULL_LLVM)(x["q"], x["kv"], x["seg"], x["sink"], x["g"],
                                                   x["topk"])


def _kernel(*a, **kw):
  return ca.sparse_attend(*a, **{**TILES, **kw}, interpret=True)


def _grads(fn, x, r, **kw):
  """Gradients w.r.t. q, kv, sink and g of Σ o·r, as one jitted program (half the time of the
  interpreted kernels run op by op; the same bits on the CPU)."""
  def f(q, kv, sink, g):
    o, _ = _run(fn, dict(x, q=q, kv=kv, sink=sink, g=g), **kw)
    return jnp.sum(o.astype(jnp.float32) * r)
  return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)), compiler_options=_FULL_LLVM)(
      x["q"], x["kv"], x["sink"], x["g"])


@pytest.mark.parametrize("m", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_forward_gradients_and_determinism(m):
  x = _inputs(20 + m, m)
  # One head with a large sink (most mass on "nowhere"), one with a very negative one.
  x["sink"] = x["sink"].at[0].set(6.0).at[1].set(-30.0)
  topk = np.asarray(x["topk"])
  assert (topk[:, 1] < 0).any() and (topk >= 0).sum() > 0      # −1 slots, rows with < K visible
  o, probs = _run_full(_kernel, x)
  ro, rprobs = _run(sa.attend_reference, x)
  # float32 throughout (HIGHEST dots): only the summation order differs.
  np.testing.assert_allclose(np.asarray(o), np.asarray(ro), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(probs), np.asarray(rprobs), rtol=1e-5, atol=1e-6)
  # global_probs written by the forward kernel (the default) and recomputed by the separate
  # kernel from lse: the same scores and lse, the same bits.
  o_apart, probs_apart = _run_full(_kernel, x, fused_probs=False)
  np.testing.assert_array_equal(np.asarray(o), np.asarray(o_apart))
  np.testing.assert_array_equal(np.asarray(probs), np.asarray(probs_apart))
  r = jnp.asarray(np.random.default_rng(m).standard_normal(o.shape), jnp.float32)
  got = _grads(_kernel, x, r)
  for g, want in zip(got, _grads(sa.attend_reference, x, r)):
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 0.1
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)
  # No atomics: the sums run in a fixed order, so the other ways of ordering the slots give the
  # same bits (two GPU runs are compared by benchmarks/csa2_kernels_gpu.py).
  for a, b in zip(got, _grads(_kernel, x, r, bounds="search", sort="rows")):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The slot plan made apart (once per selection, shared by the layers that read it): the same bits.
  plan = ca.slot_plan(x["q"], x["kv"], x["seg"], x["sink"], x["g"], x["topk"], **TILES)
  assert len(plan) == 4                                         # the pieces
  for a, b in zip(got, _grads(_kernel, x, r, plan=plan)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_window_only_and_bad_input():
  x = _inputs(30, 2, D=64, dtype=jnp.bfloat16)
  x32 = {k: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for k, v in x.items()}
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
  # bf16: exponentials and outputs are rounded to 8 significant bits (2^-9 relative each);
  # 1e-2 relative is the bf16 bound. (The bf16 gradients, with their bfloat16 slot
  # contributions, are compared on the GPU by benchmarks/csa2_kernels_gpu.py: ~2e-3.)
  o, probs = _run_full(_kernel, x, D=64)
  ro, rprobs = _run(sa.attend_reference, x32, D=64)
  assert o.dtype == jnp.bfloat16 and rel(o, ro) < 1e-2 and rel(probs, rprobs) < 1e-2
  np.testing.assert_array_equal(np.asarray(probs), np.asarray(_run_full(_kernel, x, D=64,
                                                                         fused_probs=False)[1]))
  ow, none = ca.sparse_attend(x["q"], x["kv"], x["seg"], x["sink"], window=W, scale=0.125,
                              interpret=True)
  rw, _ = sa.attend_reference(x32["q"], x32["kv"], x["seg"], x["sink"], window=W, scale=0.125)
  assert none is None and rel(ow, rw) < 1e-2
  with pytest.raises(ValueError, match="head_dim 24"):
    ca.sparse_attend(x["q"][..., :24], x["kv"][..., :24], x["seg"], x["sink"], window=W,
                     scale=0.2, interpret=True)
  big = jax.ShapeDtypeStruct((1, 1 << 16, 64, 512), jnp.bfloat16)   # Flash heads at 64K tokens
  assert "2^31" in ca.unsupported_reason(big, jax.ShapeDtypeStruct((1, 1 << 16, 512),
                                                                   jnp.bfloat16), window=128)


def test_lowers_for_cuda():
  # Triton lowering of every backward kernel on the CPU host for CUDA (cuda_lowering), with the
  # GPU layout (16 heads, D a power of two) and pieces.
  x = _inputs(31, 2, D=64, dtype=jnp.bfloat16)
  q = jnp.tile(x["q"], (1, 1, 6, 1))[:, :, :16]

  def loss(q, kv, g, sink):
    o, p = ca.sparse_attend(q, kv, x["seg"], sink, g, x["topk"], window=W, scale=0.125,
                            interpret=False, max_contrib_elems=2 * 64 * 64 * 9)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(p)

  lowered = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2, 3)), q, x["kv"], x["g"],
                           jnp.zeros((16,), jnp.float32))
  assert triton_calls(lowered) > 0   # the kernels, not a fallback to the reference


def test_window_band_reads_the_queries_in_place():
  # Where whole tiles of queries cover T (16 heads: 8 tokens a tile), the band kernel reads q, dO,
  # lse and Δ in place instead of copies padded past the last key block's window: the same bits
  # as the padded path (the tiles it no longer reads added exactly 0), and it lowers for CUDA.
  rng = np.random.default_rng(11)
  T_, hp, D = 48, 16, 32
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  seg = np.ones((B, T_), np.int32)
  seg[0, 20:] = 2
  seg[1, 41:] = 0
  args = (f(B, T_, hp, D), f(B, T_, hp, D), f(B, T_, hp) + 4.0, f(B, T_, hp), jnp.asarray(seg),
          f(B, T_, D))
  for bkw in (8, 16):
    run = lambda pad, interpret=True: ca._window_dkv(
        *args, window=W, scale=D ** -0.5, hp=hp, bkw=bkw, interpret=interpret, num_warps=4,
        num_stages=2, pad_queries=pad)
    np.testing.assert_array_equal(np.asarray(run(False)), np.asarray(run(True)))
  assert "pad" not in str(jax.make_jaxpr(lambda: run(None))())
  assert triton_calls(lower_for_cuda(lambda *a: ca._window_dkv(
      *a, window=W, scale=D ** -0.5, hp=hp, bkw=16, interpret=False, num_warps=4,
      num_stages=2), *args)) == 1


def _count(jaxpr, named: str) -> int:
  """`pallas_call` equations whose name holds `named`, nested jaxprs included."""
  return len(testing.jaxpr_eqns(jaxpr, "pallas_call", lambda e: named in str(e.params)))


def test_remat_keeps_the_named_forward():
  # Under the model's remat policy, which keeps `ops.sparse_attention.OUTPUT`, the gradient's
  # program runs the forward kernel once (global_probs with it) and no second time for the
  # backward's o and lse; with nothing kept it runs twice (also with the name kept, when the
  # kernel is a bare pallas_call, not called through jax.jit). The same bits either way.
  from dsv41_jax.model import remat_policy
  x = _inputs(40, 2)
  r = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, H, 32)), jnp.float32)

  def loss(q, g):
    o, p = _run(_kernel, dict(x, q=q, g=g))
    return jnp.sum(o * r) + jnp.sum(jnp.sin(jax.lax.stop_gradient(p)))

  def grads(policy):
    f = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1))
    calls = _count(jax.make_jaxpr(f)(x["q"], x["g"]).jaxpr, "sparse_attention_fwd")
    return calls, jax.jit(f)(x["q"], x["g"])
  kept, g_kept = grads(remat_policy)
  again, g_again = grads(jax.checkpoint_policies.nothing_saveable)
  assert (kept, again) == (1, 2)
  for a, b in zip(g_kept, g_again):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_slot_order():
  # Every way of ordering the slots by entry gives the same order: each entry's slots, ascending,
  # and all of them (−1 slots in none).
  rng = np.random.default_rng(7)
  ids = jnp.asarray(rng.integers(-1, 50, (3, 997)), jnp.int32)
  ways = [ca._slot_order(ids, 50, b, s) for b in ("count", "search") for s in ("rows", "flat")]
  for other in ways[1:]:
    for a, b in zip(ways[0], other):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  order, lo, hi = (np.asarray(a) for a in ways[0])
  ids = np.asarray(ids)
  for b in range(3):
    for n in range(50):
      rows = order[b, lo[b, n, 0]:hi[b, n, 0]]
      assert (ids[b, rows] == n).all() and (np.diff(rows) > 0).all()
      assert len(rows) == (ids[b] == n).sum()
  # "flat" (the default) folds the batch row into one 1-D sort; past 2^31 folded positions it
  # sorts per row instead.
  sort_ranks = lambda shape: [e.params["dimension"] for e in jax.make_jaxpr(
      lambda i: ca._slot_order(i, 50))(jax.ShapeDtypeStruct(shape, jnp.int32)).jaxpr.eqns
      if e.primitive.name == "sort"]
  assert sort_ranks((3, 997)) == [0] and sort_ranks((4, 1 << 29)) == [1]


def _op(policy, x, D=32):
  return dispatch.call("sparse_attention", x["q"], x["kv"], x["seg"], x["sink"], x["g"], x["topk"],
                       policy=policy, window=W, scale=D ** -0.5)


def test_dispatcher_runs_the_kernel_and_falls_back(caplog):
  x = _inputs(4, 2)
  assert dispatch.choose("sparse_attention", "kernel", x["q"], x["kv"], x["seg"], x["sink"],
                         x["g"], x["topk"], window=W, scale=0.125)[0] == (
      "pallas_kernels.csa2_attention:sparse_attend")
  o, _ = _op("kernel", x)
  ro, _ = _run(sa.attend_reference, x)
  np.testing.assert_allclose(np.asarray(o), np.asarray(ro), rtol=1e-5, atol=1e-5)
  # head_dim 24 is no power of two: under "auto" the XLA "masked" form runs and says so once;
  # under "kernel" it is one error naming the op, the policy and the reason.
  rng = np.random.default_rng(5)
  y = dict(x, q=jnp.asarray(rng.standard_normal((B, T, H, 24)), jnp.float32),
           kv=jnp.asarray(rng.standard_normal((B, T, 24)), jnp.float32),
           g=jnp.asarray(rng.standard_normal(x["g"].shape[:2] + (24,)), jnp.float32))
  notices._NOTED.clear()
  with caplog.at_level(logging.INFO):
    for _ in range(2):
      o, _ = _op("auto", y, D=24)
  assert sum("runs the reference" in r.message and "head_dim 24" in r.message
             for r in caplog.records) == 1
  np.testing.assert_array_equal(np.asarray(o), np.asarray(_run(sa.attend, y, D=24)[0]))
  with pytest.raises(dispatch.PolicyError, match="op sparse_attention: policy 'kernel'.*head_dim 24"):
    _op("kernel", y, D=24)
  # A plan is the kernel's: handed to a call that runs the reference, it is an error.
  args = (x["q"], x["kv"], x["seg"], x["sink"], x["g"], x["topk"])
  path, plan = dispatch.make_plan("sparse_attention", "kernel", *args, window=W, scale=0.125)
  assert path == "pallas_kernels.csa2_attention:sparse_attend" and plan is not None
  assert dispatch.make_plan("sparse_attention", "reference", *args, window=W, scale=0.125)[1] is None
  with pytest.raises(ValueError, match="a plan was given, but .*ops.sparse_attention:attend"):
    dispatch.call("sparse_attention", *args, policy="reference", plan=plan, window=W, scale=0.125)


@pytest.mark.parametrize("shape, why", [
    (dict(), None), (dict(K=512), None), (dict(D=64), "head_dim 64"), (dict(H=32), "32 heads"),
    (dict(W=256), "window 256"), (dict(K=1024), "top-1024"), (dict(T=2048), "2048 tokens"),
    (dict(window_only=True), "window-only")])
def test_auto_takes_the_kernel_on_the_gpu_inside_the_measured_envelope(monkeypatch, shape, why):
  # The shape policy on abstract arguments (a GPU backend pretended): s3's and m3's shapes (top-256,
  # top-512) take the kernel.
  s = {**dict(T=4096, H=16, D=128, W=128, K=256, window_only=False), **shape}
  sd = lambda *a, dt=jnp.bfloat16: jax.ShapeDtypeStruct(a, dt)
  args = (sd(4, s["T"], s["H"], s["D"]), sd(4, s["T"], s["D"]), sd(4, s["T"], dt=jnp.int32),
          sd(s["H"], dt=jnp.float32))
  args += ((None, None) if s["window_only"] else
           (sd(4, s["T"], s["D"]), sd(4, s["T"], s["K"], dt=jnp.int32)))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  path, _ = dispatch.choose("sparse_attention", "auto", *args, window=s["W"], scale=0.1)
  if why is None:
    assert path == "pallas_kernels.csa2_attention:sparse_attend"
  else:
    assert path == "pallas_kernels.ops.sparse_attention:attend"
    (kernel,) = dispatch.OPS["sparse_attention"].kernels
    assert why in kernel.faster(args, dict(window=s["W"]))
