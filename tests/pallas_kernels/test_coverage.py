"""Every registered kernel is reached from a model path, and runs per shard on a mesh (docs/design.md §T5).

`pallas_kernels.dispatch` registers each op's kernels; these tests hold the registry to the model:

* under the policy "kernel" for every op, the forward + backward of a two-layer model (FP4 / MXFP4
  / FP8 fake quants on, both layers Full, dropless MoE), of a MoE layer at the grouped GEMM's
  tile sizes (bfloat16, d = f = 128) and Muon's update reach every registered kernel. The programs are traced, not
  compiled: reaching is a routing property, and each kernel's numbers are tested against its op
  in interpret mode in its own test file (tests/pallas_kernels/test_<kernel>.py);
* every kernel that the registry runs per batch shard gives, on an 8-device CPU mesh with the batch
  split 8 ways, its single-device result, run in interpret mode: outputs, and the gradients of
  kernels with replicated (parameter) inputs, whose per-shard partial sums the mesh must add.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv41_jax import model as model_lib
from dsv41_jax import testing
from dsv41_jax.layers.moe import MoE
from dsv41_jax.loss import objective
from optim import muon  # registers the optimizer's op, newton_schulz
from pallas_kernels import dispatch
from pallas_kernels.ops import indexer as ops_indexer
from pallas_kernels.ops import mhc as ops_mhc

ALL_KERNEL = {name: "kernel" for name in dispatch.names("model")}
assert "newton_schulz" in dispatch.names("optim")


@pytest.fixture
def reached(monkeypatch):
  """The registered kernels ("module:function") called while the test runs."""
  seen: set[str] = set()
  for _, path in dispatch.kernel_names():
    module, _, attr = path.partition(":")
    mod = importlib.import_module(module)
    orig = getattr(mod, attr)

    @functools.wraps(orig)
    def spy(*a, _orig=orig, _path=path, **k):
      seen.add(_path)
      return _orig(*a, **k)
    monkeypatch.setattr(mod, attr, spy)
  return seen


def _trace_model_grad(cfg):
  graphdef, params = nnx.split(model_lib.abstract_model(cfg))
  batch = jax.tree.map(jnp.asarray, testing.packed_batch(cfg, 0))
  bias = model_lib.zero_moe_bias(cfg)

  def loss(p):
    logits, aux = nnx.merge(graphdef, p)(batch, bias)
    return objective(cfg, logits, aux, batch)[0]
  return jax.make_jaxpr(jax.grad(loss))(params)


def test_every_registered_kernel_is_reached_from_a_model_or_optimizer_path(reached):
  # Two Full layers (the encoder's at m = 2, the decoder's at m = 1): compressor (FP4), indexer
  # (MXFP4, scores + top-k; the pool), sparse attention with its global branch, SWA keys (FP8), the
  # attention site's coefficients and the MoE site's single-pass site. index_head_dim 32: MXFP4.
  # The decoder's layer is the candidate pool's source, which the Triton indexer kernel does not
  # take: its selection runs the op's second kernel (the radix select).
  cfg = testing.tiny_config(
      num_hidden_layers=2, compress_ratios=(2, 1), kv_source_layer_ids=(0, 1),
      index_source_layer_ids=(0, 1), engram_layer_ids=(), seq_len=16, index_head_dim=32,
      fp4_main_kv=True, fp4_indexer=True, fp8_swa_kv=True, moe_dispatch="dropless",
      use_candidate_pool=True, candidate_source_layer_id=1,
      ops=dict(ALL_KERNEL, grouped_matmul="auto"))  # float32 experts: the reference
  assert "pallas_call" in str(_trace_model_grad(cfg))
  # The MoE layer at the Mosaic kernels' tiles (bf16 operands, d and f multiples of 128).
  mcfg = testing.tiny_config(hidden_size=128, moe_intermediate_size=128, dtype="bfloat16",
                             moe_dispatch="dropless", ops={"grouped_matmul": "kernel"})
  graphdef, params = nnx.split(MoE(mcfg, nnx.Rngs(0)))
  seg, img = jnp.ones((1, 64), jnp.int32), jnp.zeros((1, 64), bool)
  bias = jnp.zeros((2, mcfg.n_routed_experts), jnp.float32)

  def moe_loss(p, x):
    y, _ = nnx.merge(graphdef, p)(x, segment_ids_BxT=seg, image_mask_BxT=img, bias_2xE=bias)
    return jnp.sum(y.astype(jnp.float32))
  jax.make_jaxpr(jax.grad(moe_loss))(params, jnp.ones((1, 64, 128), jnp.bfloat16))
  # The optimizer: Muon's update with the policy "kernel" for its Newton–Schulz.
  tx = muon.scale_by_muon(0.95, 0.18, lambda path: False, "kernel")
  params = {"w": jnp.ones((4, 8)), "v": jnp.ones((2, 8, 4))}
  jax.make_jaxpr(lambda g: tx.update(g, tx.init(params))[0])(params)
  registered = {path for _, path in dispatch.kernel_names()}
  assert reached == registered, f"registered kernels no path reached: {registered - reached}"


# --- per shard on a mesh ---------------------------------------------------------------------------

B = 8


def _rng_inputs(name, rng):
  """(array arguments, static arguments, the arguments whose gradients are compared) of op `name`:
  those of ops with replicated inputs (a fake quant's gradient is the identity; the indexer's
  inputs are all batched)."""
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  if name.startswith("fake_quant_"):
    return (f(B, 3, 32) * 4,), {}, ()
  if name == "hc_coefficients":
    n, d = 4, 16
    return ((f(B, 3, n, d), 0.2 * f((2 + n) * n, n * d), f((2 + n) * n), 1 + 0.1 * f(3)),
            dict(iters=3, hc_eps=1e-6, norm_eps=1e-20), (0, 1, 2, 3))
  if name == "hc_site":
    n, d = 4, 16
    comb = ops_mhc.sinkhorn_project(f(B, 3, n, n), 20, 1e-6)
    pos = lambda *s: jnp.asarray(rng.uniform(0.1, 1.0, s), jnp.float32)  # noqa: E731
    return ((f(B, 3, n, d), f(B, 3, d), pos(B, 3, n), comb, pos(B, 3, n), 0.2 * f((2 + n) * n, n * d),
             f((2 + n) * n), 1 + 0.1 * f(3), 1 + 0.1 * f(d)),
            dict(iters=3, hc_eps=1e-6, norm_eps=1e-20), tuple(range(9)))
  T, H, D, m, K = 8, 2, 16, 2, 3
  N = T // m
  seg = np.ones((B, T), np.int32)
  seg[::2, 5:] = 2                          # two documents in every other row
  last = np.broadcast_to((np.arange(N) + 1) * m - 1, (B, N)).astype(np.int32)
  eseg = seg[:, ::m] * (seg[:, ::m] == seg[:, m - 1::m])
  eseg = np.where(eseg > 0, eseg, -1).astype(np.int32)
  if name == "sparse_attention":
    vis = ops_indexer.entry_visible(jnp.asarray(eseg), jnp.asarray(last), jnp.asarray(seg))
    topk, _ = ops_indexer.select_topk(f(B, T, N), vis, K)
    return ((f(B, T, H, D), f(B, T, D), jnp.asarray(seg), f(H), f(B, N, D), topk),
            dict(window=4, scale=D ** -0.5), (0, 1, 3, 4))
  if name == "indexer_topk":
    return ((f(B, T, H, D), f(B, T, H), f(B, N, D), jnp.asarray(eseg), jnp.asarray(last),
             jnp.asarray(seg), None), dict(k=K), ())
  raise KeyError(name)


BATCHED = [n for n, op in dispatch.OPS.items() if any(k.batched is not None for k in op.kernels)]


@pytest.mark.parametrize("name", BATCHED)
def test_batched_kernel_on_a_mesh_equals_one_device(name):
  mesh = testing.cpu_mesh({"data": B})
  args, static, diff = _rng_inputs(name, np.random.default_rng(len(name)))
  (kernel,) = [k for k in dispatch.OPS[name].kernels if k.batched is not None]
  op = lambda *a: dispatch.call(name, *a, policy="kernel", **static)  # noqa: E731

  def floats(out):
    return [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating)]

  def run(*a):
    if not diff:
      return op(*a)

    def loss(*d):
      b = list(a)
      for i, v in zip(diff, d):
        b[i] = v
      return sum(jnp.sum(o * (1.0 + 0.1 * k)) for k, o in enumerate(floats(op(*b))))
    return op(*a), jax.grad(loss, argnums=tuple(range(len(diff))))(*[a[i] for i in diff])

  want = jax.jit(run)(*args)
  batch = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, batch) if b and a is not None else a
              for a, b in zip(args, kernel.batched)]
    jaxpr = str(jax.make_jaxpr(op)(*placed))
    got = jax.jit(run)(*placed)
  assert "shard_map" in jaxpr
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    if jnp.issubdtype(w.dtype, jnp.floating):
      # Batch rows are computed alike on a shard; a replicated parameter's gradient sums 8
      # shards' partial sums in another order.
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6,
                                 atol=2e-6 * float(jnp.max(jnp.abs(w))))
    else:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert jax.tree.leaves(got)[0].sharding.spec[0] == "data"


def test_attention_plan_on_a_mesh_equals_one_device():
  # The attention's slot plan made once under GSPMD (the whole batch) and handed to the kernel,
  # which runs per batch shard: the gradients equal the single-device ones without a plan.
  mesh = testing.cpu_mesh({"data": B})
  (q, kv, seg, sink, g, topk), static, _ = _rng_inputs("sparse_attention", np.random.default_rng(3))

  def grads(with_plan):
    def loss(q, kv, sink, g):
      a = (q, kv, seg, sink, g, topk)
      plan = dispatch.make_plan("sparse_attention", "kernel", *a, **static)[1] if with_plan else None
      o, _ = dispatch.call("sparse_attention", *a, policy="kernel", plan=plan, **static)
      return jnp.sum(o * o)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  want = grads(False)(q, kv, sink, g)
  batch = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    got = grads(True)(jax.device_put(q, batch), jax.device_put(kv, batch), sink,
                      jax.device_put(g, batch))
  for a, b in zip(got, want):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6 * scale)


def test_auto_runs_the_attention_kernel_in_the_model_on_a_gpu(monkeypatch):
  # The model's train gradient at s3's attention shapes (head_dim 128, window 128, top-256, 4,096
  # tokens) lowered for CUDA under "auto" with a GPU backend: the deterministic kernel's forward
  # (which writes global_probs too, so the separate probs kernel is not), dq, window band and
  # entry-sum kernels are in the scanned, rematerialised layers (every other op on its
  # reference); at head_dim 64, outside the measured envelope, none is.
  from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  ops = dict({n: "reference" for n in dispatch.names("model")}, sparse_attention="auto")

  def lowered(head_dim):
    cfg = testing.tiny_config(head_dim=head_dim, qk_rope_head_dim=64, index_head_dim=64,
                              sliding_window=128, seq_len=4096, index_topk=256, remat=True,
                              dtype="bfloat16", ops=ops)
    graphdef, state = nnx.split(model_lib.abstract_model(cfg))
    batch = jax.tree.map(jnp.asarray, testing.packed_batch(cfg, 0))
    bias = model_lib.zero_moe_bias(cfg)
    loss = lambda p: objective(cfg, *nnx.merge(graphdef, p)(batch, bias), batch)[0]  # noqa: E731
    return lower_for_cuda(jax.grad(loss), state)

  text = lowered(128).as_text()
  for name in ("sparse_attention_fwd", "csa2_dq", "csa2_window_dkv", "csa2_entry_sums"):
    assert name in text, name
  assert "sparse_attention_probs" not in text
  assert triton_calls(lowered(64)) == 0


def test_implementation_answers_for_another_backend_without_running_or_logging(caplog):
  """`dispatch.implementation` decides by the rules `call` uses, for a backend other than this
  process's (shapes only), says nothing in the log, and leaves the process's backend as it was."""
  sd = jax.ShapeDtypeStruct

  def attention(head_dim):
    bf = jnp.bfloat16
    return (sd((4, 4096, 16, head_dim), bf), sd((4, 4096, head_dim), bf),
            sd((4, 4096), jnp.int32), sd((16,), jnp.float32), sd((4, 2048, head_dim), bf),
            sd((4, 4096, 256), jnp.int32))
  kw = dict(window=128, scale=128 ** -0.5, impl="masked", query_chunk=None)
  with caplog.at_level("DEBUG"):
    on = lambda backend, d=128, policy="auto": dispatch.implementation(  # noqa: E731
        "sparse_attention", policy, *attention(d), backend=backend, **kw)
    assert on("gpu") == "pallas_kernels.csa2_attention:sparse_attend"
    assert on("cpu") == on("gpu", 64) == on("gpu", policy="reference") == (
        "pallas_kernels.ops.sparse_attention:attend")
    assert on("cpu", policy="kernel") == "pallas_kernels.csa2_attention:sparse_attend"
    with pytest.raises(dispatch.PolicyError, match="cannot run on 'tpu'"):
      on("tpu", policy="kernel")
  assert dispatch.backend() == jax.default_backend() == "cpu"
  assert not [r for r in caplog.records if "policy" in r.getMessage()]
