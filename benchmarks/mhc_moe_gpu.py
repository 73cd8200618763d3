"""mHC site and routed-experts layer at s3's shapes on the GPU: reference, fast XLA, kernel (issue 27).

  PYTHONUNBUFFERED=1 timeout 200 python3 -u benchmarks/mhc_moe_gpu.py --json=$OUT/r.json \
      --baseline-moe=../dsv41_jax/layers/moe_dispatch.py        # H200, one call
  PYTHONUNBUFFERED=1 timeout 300 python3 -u benchmarks/mhc_moe_gpu.py --only=site \
      --json=$OUT/site.json                                      # the site rows alone
  PYTHONUNBUFFERED=1 timeout 300 python3 -u benchmarks/mhc_moe_gpu.py --only=site --copy \
      --json=$OUT/site.json                                      # + the card's copy rate
  JAX_PLATFORMS=cpu python benchmarks/mhc_moe_gpu.py --smoke    # CPU: tiny shapes, runs everything

mHC (configs/small.py:s3 at 4 × 4096 tokens, d 1024, hc_mult 4, 20 Sinkhorn iterations; streams X
in s3's `hc_stream_dtype`, bfloat16, or `--streams=float32` as s1/s2 keep them (the rows before
issue 27's fused site were float32), bf16 sublayer output F): one single-pass site (previous expand,
this site's coefficients, collapse + norm) forward and forward+backward (the gradient of a random
projection of all five outputs w.r.t. all nine inputs), for
- `reference`: `dsv41_jax.layers.mhc.hc_site` (HIGHEST einsums for expand/collapse when RESULTS was measured,
  the broadcast forms since; `fori_loop` Sinkhorn; autodiff);
- `kernel`: `pallas_kernels.mhc.hc_site`, the op's registered kernel until session 69 ("fast" in RESULTS' first
  rows: broadcast multiply-adds with hand VJPs, the mix GEMM, the Sinkhorn gates as one Triton
  kernel and its recomputing backward; the fused single-pass Triton site measured there as
  `kernel` was retired); `kernel gates block 64`: the same with 64-token gate blocks;
  (the streaming kernel `pallas_kernels/mhc_stream.py` measured as `stream` was removed after
  session 64: 9.6x slower forward+backward on an H100, RESULTS.md; in git history at e4c11d9);
- `rows`: `pallas_kernels.mhc_rows.hc_site`, the dispatcher's kernel since session 69 (session 68: one Triton pass forward reading X and F,
  writing X', x and the two means; the mix GEMM over X'; one Triton pass backward reading the mix's
  cotangent of X' from one XLA product), at its default tiles; `--rows-tiles` adds other tiles
  (FWDxCHUNKwWARPS/BWDxCHUNKwWARPS, e.g. 8x256w8/16x64w8);
- `--copy`: −X, one read and one write of X, timed the same way (`common.time_calls`: calls back
  to back since session 64; its row then, every call waited on alone, was 0.276 ms against
  0.101 ms back to back on an H100, RESULTS.md);
and the pieces alone: expand (the einsum form measured as the reference before issue 27; the ops'
expand is now the broadcast form, so the site rows above were measured with the einsum reference),
the mix x̂ · fnᵀ with mean(x̂²) (the op's XLA form, a cuBLAS SGEMM and a reduction) and the gates (sigmoids +
Sinkhorn) on [T, (2+n)n].
The fused single-pass Triton site of session 58 (`pallas_kernels/mhc_site.py`, one forward and
one backward kernel) measured slower than `kernel` at all five tiles it was timed at (session 59,
H100, s3, bfloat16 streams: kernel 0.474 / 1.216 ms forward / forward+backward, fused 0.807 /
2.296 at its default 64×32 tiles, best 0.644 forward at 16×64 and 2.213 forward+backward at 16×32,
reference 0.665 / 1.880) and was removed (in git history at 8873ae8).
Minimum bytes (each input read once, each output written once, in their dtypes: x and gx are
float32): forward X, F read, X', x written; forward+backward adds X, F, X' (for d fn = gyᵀ x̂),
gX', gx read and gX, gF written; at s3 with bfloat16 streams 22·d and 40·d bytes a token.

MoE (s3: 48 experts, top-4, 1024 -> 512, 16,384 tokens, skewed routing with two empty experts):
`moe_dispatch.routed_experts` dropless forward and forward+backward (gradients w.r.t. x and the
three weights), this tree's code vs `--baseline-moe` (the module file of an earlier tree, loaded
under another name) vs capacity mode (factor 1.25). Useful FLOPs: 3 products × 2·pairs·D·F forward,
3× that forward+backward. Then the whole MoE layer (router, routed and shared experts) as the step
runs it, 4 layers in a scan under layer remat, with the model's remat policy, with it but the
experts' weights cast again in the backward, with `--baseline-moe`'s module, and without the MoE's
names (`moe_remat_cases`).

Ceilings: 4.3 TB/s copy and 790 TFLOP/s bf16 matrix rate (the H200 as measured here, KINDS.md).
Imports only jax/numpy/flax and this repository (runs on the GPU image without the data stack).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import elapsed, header, log, time_calls  # noqa: E402
from dsv41_jax.layers import mhc, moe_dispatch  # noqa: E402
from pallas_kernels import mhc as mhc_kernel, mhc_rows  # noqa: E402

COPY_BPS, MMA_FLOPS = 4.3e12, 790e12
KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)
ROWS: list[dict] = []
_REFS: dict = {}


def _save(path):
  if path:
    with open(path, "w") as f:
      json.dump(ROWS, f, indent=1)


def _row(**kw):
  ROWS.append(kw)
  print(json.dumps(kw), flush=True)


def site_inputs(rng, lead, n, d, streams):
  X = rng.standard_normal((*lead, n, d)).astype(np.float32) * rng.uniform(0.5, 2, (*lead, 1, 1))
  F = rng.standard_normal((*lead, d)).astype(np.float32)
  pre = rng.uniform(0.05, 1.0, (*lead, n)).astype(np.float32)
  post = rng.uniform(0.0, 2.0, (*lead, n)).astype(np.float32)
  logits = (2 * rng.standard_normal((*lead, n, n))).astype(np.float32)
  fn = (0.2 / np.sqrt(n * d) * rng.standard_normal(((2 + n) * n, n * d))).astype(np.float32)
  base = rng.standard_normal(((2 + n) * n,)).astype(np.float32)
  scale = rng.uniform(0.5, 1.5, (3,)).astype(np.float32)
  w = rng.uniform(0.5, 1.5, (d,)).astype(np.float32)
  comb = mhc.sinkhorn_project(jnp.asarray(logits), 20, 1e-6)
  return (jnp.asarray(X, streams), jnp.asarray(F, jnp.bfloat16), jnp.asarray(post), comb,
          jnp.asarray(pre), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale), jnp.asarray(w))


def _loss_grad(f, args, seed=1):
  outs = jax.eval_shape(f, *args)
  outs = outs if isinstance(outs, tuple) else (outs,)
  rng = np.random.default_rng(seed)
  ws = [jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in outs]

  def loss(*a):
    o = f(*a)
    o = o if isinstance(o, tuple) else (o,)
    return sum(jnp.vdot(w.astype(jnp.float32), oi.astype(jnp.float32)) for w, oi in zip(ws, o))
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))


def _max_rel(got, want):
  out = []
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    out.append(float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
  return max(out)


def time_case(case, impl, fn, args, reps, nbytes=None, flops=None, ref=None, **extra):
  try:
    t, first = time_calls(fn, *args, reps=reps)
  except Exception as e:  # noqa: BLE001  (a failing variant is reported, the others still run)
    _row(case=case, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
    traceback.print_exc()
    return None
  row = dict(case=case, impl=impl, **extra, ms=round(t * 1e3, 4), first_s=round(first, 2))
  if nbytes:
    row.update(GBps=round(nbytes / t / 1e9, 1), of_copy=round(nbytes / t / COPY_BPS, 3))
  if flops:
    row.update(TFLOPs=round(flops / t / 1e12, 1), of_mma=round(flops / t / MMA_FLOPS, 3))
  if ref is not None:
    row["max_rel_vs_reference"] = _max_rel(fn(*args), ref)
  _row(**row)
  return t


def _rows_tiles(*a, fwd, bwd, interpret):
  return mhc_rows.hc_site(*a, **KW, fwd_tiles=fwd, bwd_tiles=bwd, interpret=interpret)


def mhc_cases(lead, n, d, reps, budget_s, interpret, impls, pieces):
  rng = np.random.default_rng(0)
  args = site_inputs(rng, lead, n, d, ARGS.streams)
  tokens = int(np.prod(lead))
  sx, sf, s32 = jnp.dtype(ARGS.streams).itemsize, 2, 4
  fwd_bytes = tokens * (2 * n * d * sx + d * sf + d * s32)          # X, F read; X', x written
  # + X, F, X', gX', gx read; gX, gF written
  bwd_bytes = fwd_bytes + tokens * (4 * n * d * sx + 2 * d * sf + d * s32)
  site = {
      "reference": lambda *a: mhc.hc_site(*a, **KW),
      "kernel": lambda *a: mhc_kernel.hc_site(*a, **KW, interpret=interpret),
      "kernel gates block 64": lambda *a: mhc_kernel.hc_site(*a, **KW, interpret=interpret,
                                                             block_tokens=64),
      "rows": lambda *a: mhc_rows.hc_site(*a, **KW, interpret=interpret),
  }
  for spec in ARGS.rows_tiles:
    fwd, bwd = (tuple(int(v) for v in t.replace("w", "x").split("x")) for t in spec.split("/"))
    site[f"rows {spec}"] = functools.partial(_rows_tiles, fwd=fwd, bwd=bwd, interpret=interpret)
    impls = (*impls, f"rows {spec}")
  if ARGS.copy and "copy" not in _REFS:
    _REFS["copy"] = True
    copy_bytes = 2 * tokens * n * d * sx
    time_case("copy of X (−X: read + write)", "XLA", jax.jit(jnp.negative), args[:1], reps,
              nbytes=copy_bytes, streams=ARGS.streams)
  if "site" not in _REFS:
    _REFS["site"] = (jax.jit(site["reference"])(*args), _loss_grad(site["reference"], args)(*args))
  ref_fwd, ref_grad = _REFS["site"]
  for impl in impls:
    f = site[impl]
    if elapsed() > budget_s:
      break
    if not ARGS.quick:
      time_case("mhc site fwd", impl, jax.jit(f), args, reps, nbytes=fwd_bytes, ref=ref_fwd,
                streams=ARGS.streams)
    time_case("mhc site fwd+bwd", impl, _loss_grad(f, args), args, reps, nbytes=bwd_bytes,
              ref=ref_grad, streams=ARGS.streams)
    _save(ARGS.json)
  if not pieces:
    return
  X, F, post, comb = args[:4]
  e_args = (X, post, comb, F)
  if ARGS.quick:
    e_args = ()
  e_bytes = tokens * (2 * n * d * sx + d * sf)
  for impl, f in (("einsum", _einsum_expand), ("ops (broadcast)", mhc.expand)) if e_args else ():
    time_case("expand fwd", impl, jax.jit(f), e_args, reps, nbytes=e_bytes)
    time_case("expand fwd+bwd", impl, _loss_grad(f, e_args), e_args, reps,
              nbytes=e_bytes + tokens * (3 * n * d * sx + 2 * d * sf))
  fn = args[5]
  f = lambda X, fn: mhc.hc_mix(X, fn, KW["norm_eps"])  # noqa: E731
  time_case("mix (x̂·fnᵀ, mean square) fwd", "op (XLA)", jax.jit(f), (X, fn), reps,
            nbytes=tokens * n * d * sx)
  time_case("mix (x̂·fnᵀ, mean square) fwd+bwd", "op (XLA)", _loss_grad(f, (X, fn)), (X, fn),
            reps, nbytes=tokens * n * d * sx * 4)   # + backward: x̂ read twice, dx̂ written
  z = jnp.asarray(2 * rng.standard_normal((tokens, (2 + n) * n)), jnp.float32)
  gate_ref = lambda z: _ref_gates(z, n)
  gate_fast = lambda z: mhc_kernel.gates(z, (n, 20, 1e-6, 16, interpret))
  for impl, g in (("reference", gate_ref), ("kernel", gate_fast)):
    time_case("gates (sigmoids + sinkhorn) fwd", impl, jax.jit(g), (z,), reps,
              nbytes=tokens * (2 + n) * n * 8)
    time_case("gates (sigmoids + sinkhorn) fwd+bwd", impl, _loss_grad(g, (z,)), (z,), reps,
              nbytes=tokens * (2 + n) * n * 16)
  _save(ARGS.json)


def _einsum_expand(X, post, comb, F):
  """expand as an einsum over the stream axis (the reference before issue 27)."""
  mixed = jnp.einsum("...jk,...jd->...kd", comb, X.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  return (post[..., None] * F.astype(jnp.float32)[..., None, :] + mixed).astype(X.dtype)


def _ref_gates(z, n):
  pre = jax.nn.sigmoid(z[..., :n]) + 1e-6
  post = 2.0 * jax.nn.sigmoid(z[..., n:2 * n])
  comb = mhc.sinkhorn_project(z[..., 2 * n:].reshape(*z.shape[:-1], n, n), 20, 1e-6)
  return jnp.concatenate([pre, post, comb.reshape(*z.shape[:-1], n * n)], -1)


def _load_baseline(path):
  spec = importlib.util.spec_from_file_location("baseline_moe_dispatch", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def moe_cases(tokens, d, f, e, k, reps, budget_s, impl):
  rng = np.random.default_rng(1)
  p = np.exp(0.9 * rng.standard_normal(e))
  p[rng.choice(e, 2, replace=False)] = 0.0
  p /= p.sum()
  experts = np.stack([rng.choice(e, k, replace=False, p=p) for _ in range(tokens)])
  b = 4 if tokens % 4 == 0 else 1
  experts = jnp.asarray(experts.reshape(b, tokens // b, k), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (b, tokens // b, k)), jnp.float32)
  valid = jnp.ones((b, tokens // b), bool)
  x = jnp.asarray(rng.standard_normal((b, tokens // b, d)), jnp.bfloat16)
  w1, w3 = (jnp.asarray(rng.standard_normal((e, d, f)) / np.sqrt(d), jnp.float32) for _ in "ab")
  w2 = jnp.asarray(rng.standard_normal((e, f, d)) / np.sqrt(f), jnp.float32)
  fl = 3 * 2 * tokens * k * d * f
  variants = {"dropless (this tree)": (moe_dispatch, dict(
      mode="dropless", policy={"ragged_dot": "reference"}.get(impl, impl)))}
  if ARGS.baseline_moe and os.path.exists(ARGS.baseline_moe):
    variants["dropless (baseline)"] = (_load_baseline(ARGS.baseline_moe),
                                       variants["dropless (this tree)"][1])
  variants["capacity 1.25"] = (moe_dispatch, dict(mode="capacity", capacity_factor=1.25))
  ref_fwd = ref_grad = None
  for name, (mod, kw) in variants.items():
    if elapsed() > budget_s:
      break
    fwd = lambda x, w1, w3, w2, mod=mod, kw=kw: mod.routed_experts(
        x, weights, experts, valid, w1, w3, w2, swiglu_limit=10.0, **kw)[0]
    args = (x, w1, w3, w2)
    grad = _loss_grad(fwd, args)
    if ref_fwd is None:
      ref_fwd, ref_grad = jax.jit(fwd)(*args), grad(*args)
    time_case("moe routed fwd", name, jax.jit(fwd), args, reps, flops=fl, ref=ref_fwd)
    time_case("moe routed fwd+bwd", name, grad, args, reps, flops=3 * fl, ref=ref_grad)
    _save(ARGS.json)


def moe_remat_cases(tokens, d, f, e, k, reps, budget_s, impl, layers=4):
  """The MoE layer as the step runs it: `layers` layers (one weight set, stacked) in a `lax.scan`
  under layer remat, x <- x + MoE(x) with the router, dropless routed experts and the shared
  expert; forward+backward (gradients w.r.t. x and every weight). The model's remat policy
  against: the same policy with the routed experts' bf16 weights ([w1 | w3] and w2, kept by name
  since the SwiGLU VJP change) cast again in the backward; `--baseline-moe`'s module (an earlier
  tree's moe_dispatch.py) in the layer under the model's policy; the policy without
  `moe_dispatch.KEPT` at all (the router logits, the pair sort, the layer output and the weights
  recomputed in the backward). Useful FLOPs: the routed and shared experts' products and the
  router's, 3× forward (recomputed products not counted)."""
  from flax import nnx
  from dsv41_jax import model as model_lib
  from dsv41_jax.config import ModelConfig
  from dsv41_jax.layers import moe as moe_lib
  from dsv41_jax.layers.moe import MoE
  cfg = ModelConfig(hidden_size=d, n_routed_experts=e, num_experts_per_tok=k,
                    moe_intermediate_size=f, n_shared_experts=1, dtype="bfloat16",
                    moe_dispatch="dropless",
                    ops=dict(grouped_matmul={"ragged_dot": "reference"}.get(impl, impl)))
  graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0)))
  stacked = jax.tree.map(lambda a: jnp.stack([a] * layers), state)
  b = 4 if tokens % 4 == 0 else 1
  seg = jnp.ones((b, tokens // b), jnp.int32)
  image = jnp.zeros((b, tokens // b), bool)
  bias = jnp.zeros((2, e), jnp.float32)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((b, tokens // b, d)), jnp.bfloat16)

  def body(x, p):
    y, aux = nnx.merge(graphdef, p)(x, segment_ids_BxT=seg, image_mask_BxT=image, bias_2xE=bias)
    return (x + y).astype(x.dtype), aux["balance_loss"]

  without = jax.checkpoint_policies.save_only_these_names(
      *(n for n in model_lib.SAVED_NAMES if n != moe_dispatch.KEPT))
  weight_shapes = {(e, d, 2 * f), (e, f, d)}

  def weights_cast_again(prim, *avals, **params):
    weight = (prim.name == "name" and avals[0].dtype == jnp.bfloat16
              and avals[0].shape in weight_shapes)
    return not weight and model_lib.remat_policy(prim, *avals, **params)

  here = moe_lib.moe_dispatch
  variants = {"model remat policy": (model_lib.remat_policy, here),
              "model remat policy, expert weights cast again in the backward":
                  (weights_cast_again, here)}
  if ARGS.baseline_moe and os.path.exists(ARGS.baseline_moe):
    variants["model remat policy, baseline moe_dispatch"] = (
        model_lib.remat_policy, _load_baseline(ARGS.baseline_moe))
  variants["without moe_dispatch.KEPT"] = (
      lambda prim, *a, **kw: prim.name == "top_k" or without(prim, *a, **kw), here)
  fl = layers * 3 * (2 * tokens * d * f * (3 * k + 3) + 2 * tokens * d * e)
  ref = None
  for name, (policy, dispatch_module) in variants.items():
    if elapsed() > budget_s:
      break
    step = jax.checkpoint(body, prevent_cse=False, policy=policy)
    run = lambda x, p, step=step: jax.lax.scan(step, x, p)
    moe_lib.moe_dispatch = dispatch_module   # the layer reads it when traced (the first call)
    try:
      grad = _loss_grad(run, (x, stacked))
      if ref is None:
        ref = grad(x, stacked)
      time_case(f"moe layer x{layers} scan+remat fwd+bwd", name, grad, (x, stacked), reps,
                flops=fl, ref=ref)
    finally:
      moe_lib.moe_dispatch = here
    _save(ARGS.json)


def main():
  global ARGS
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--budget-s", type=float, default=150.0)
  ap.add_argument("--json", default="")
  ap.add_argument("--baseline-moe", default="")
  ap.add_argument("--only", choices=["mhc", "site", "moe", ""], default="",
                  help="site: the mHC site rows alone (reference, kernel)")
  ap.add_argument("--streams", choices=["bfloat16", "float32"], default="bfloat16",
                  help="the mHC streams' dtype (s3: bfloat16)")
  ap.add_argument("--quick", action="store_true",
                  help="mHC only: the site forward+backward (kernel) and the gates")
  ap.add_argument("--rows-tiles", nargs="*", default=[], metavar="FWD/BWD",
                  help="site: the rows kernel at these tiles too, e.g. 8x256w8/16x64w8 "
                       "(tokens x channels, warps; forward/backward)")
  ap.add_argument("--copy", action="store_true",
                  help="site: a row timing -X (one read, one write of the streams)")
  ARGS = ap.parse_args()
  if ARGS.baseline_moe and not os.path.exists(ARGS.baseline_moe):
    ap.error(f"--baseline-moe {ARGS.baseline_moe!r}: no such file")
  print(header())
  cpu = jax.default_backend() == "cpu"
  if ARGS.smoke:
    lead, n, d, moe = (2, 16), 4, 64, (64, 128, 128, 8, 2)
    reps = 2
  else:
    lead, n, d, moe = (4, 4096), 4, 1024, (16384, 1024, 512, 48, 4)
    reps = ARGS.reps
  site_impls = ("reference", "kernel", "rows")
  t0 = time.time()
  if ARGS.quick:
    mhc_cases(lead, n, d, reps, ARGS.budget_s, cpu, ("kernel",), True)
  elif ARGS.only == "site":
    mhc_cases(lead, n, d, reps, ARGS.budget_s, cpu, site_impls, False)
  elif ARGS.only in ("", "mhc"):
    mhc_cases(lead, n, d, reps, ARGS.budget_s * 0.35, cpu, site_impls, False)
  if ARGS.only in ("", "moe") and not ARGS.quick:
    # the layer under remat first: the step's MoE path (the routed-experts rows stand in RESULTS)
    moe_remat_cases(*moe, reps=reps, budget_s=ARGS.budget_s * 0.5,
                    impl="ragged_dot" if cpu else "auto")
    moe_cases(*moe, reps=reps, budget_s=ARGS.budget_s * 0.7,
              impl="ragged_dot" if cpu else "auto")
  if ARGS.only in ("", "mhc") and not ARGS.quick:
    mhc_cases(lead, n, d, reps, ARGS.budget_s, cpu, ("kernel gates block 64",), True)
  _save(ARGS.json)
  print(f"# done in {time.time() - t0:.0f} s")
  for r in ROWS:
    print(" | ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
  main()
