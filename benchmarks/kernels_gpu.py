"""Pallas kernels vs their XLA references on one GPU, side by side (TRAINING.md §5).

  python benchmarks/kernels_gpu.py                       # H200: full-size shapes, markdown table
  python benchmarks/kernels_gpu.py --sweep               # also try a few block sizes per kernel
  python benchmarks/kernels_gpu.py --cases=fp4,hc --tokens=4096   # a subset, smaller
  python benchmarks/kernels_gpu.py --smoke               # CPU: tiny shapes, kernels interpreted

For each kernel the same inputs go through the XLA reference (the model's pure function under
`jax.jit`) and the Pallas kernel; the table gives the median wall time of `--reps` calls, the bytes
each call must move at least (inputs read once + outputs written once), the achieved GB/s and its
fraction of the ~4.3 TB/s device-to-device copy ceiling measured on the H200, the speed-up
(XLA ms / Pallas ms) and the largest difference between the two outputs (FP4 must be 0).

Cases (full-size V4.1-Flash shapes):
- `fp4_main_kv`: main-KV fake quantization of [entries, 512] bf16 (MODEL.md §9.2).
- `hc_coefficients`: one mHC site, X [tokens, 4, 5120] bf16 -> pre, post, comb (MODEL.md §3.2).
- `hc_coefficients fwd+bwd`: the same under `jax.grad` (the kernel's backward is the reference VJP,
  so this row shows what the fused forward saves inside a training step).

Imports only jax/numpy and this repository, so it runs on the GPU machine without the data stack.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv41_jax import quant  # noqa: E402
from dsv41_jax.layers import mhc  # noqa: E402
from pallas_kernels import fp4 as fp4_kernel  # noqa: E402
from pallas_kernels import mhc as mhc_kernel  # noqa: E402

COPY_CEILING_GBS = 4300.0  # H200 device-to-device copy, TRAINING.md §5
HC = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)


def _time(fn, args, reps: int) -> float:
  """Median milliseconds of `reps` calls after one compile-and-warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def _max_diff(a, b) -> float:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in zip(leaves_a, leaves_b))


def _nbytes(*trees) -> int:
  return sum(int(x.size) * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t))


def bench_pair(name, shape_txt, ref_fn, kern_fns, args, reps):
  """Rows for one case: the XLA reference and each Pallas variant (label -> fn)."""
  rows = []
  _log(f"{name}: xla reference")
  try:
    ref_out = ref_fn(*args)
    moved = _nbytes(args, ref_out)
    ref_ms = _time(ref_fn, args, reps)
    rows.append((name, shape_txt, "xla", ref_ms, moved, None, 0.0))
  except Exception as e:  # keep going: a failing case is reported, not fatal
    rows.append((name, shape_txt, f"xla FAILED: {type(e).__name__}: {str(e)[:200]}", None, 0, None,
                 None))
    traceback.print_exc()
    return rows
  for label, fn in kern_fns.items():
    _log(f"{name}: pallas {label}")
    try:
      out = fn(*args)
      diff = _max_diff(out, ref_out)
      ms = _time(fn, args, reps)
      rows.append((name, shape_txt, f"pallas {label}", ms, moved, ref_ms / ms, diff))
    except Exception as e:
      rows.append((name, shape_txt, f"pallas {label} FAILED: {type(e).__name__}: {str(e)[:300]}",
                   None, moved, None, None))
      traceback.print_exc()
  return rows


def fp4_case(entries: int, dim: int, interpret: bool, sweep: bool, reps: int):
  x = jax.random.normal(jax.random.key(0), (entries, dim), jnp.float32)
  # Block magnitudes e^-8 .. e^5: subnormal E4M3 scales up to amax ≈ 800 < 2688 (no overflow).
  block_mag = jnp.exp(jnp.clip(2.0 * jax.random.normal(jax.random.key(1), (entries, dim // 16, 1)),
                               -8, 5))
  x = (x.reshape(entries, dim // 16, 16) * block_mag).reshape(entries, dim).astype(jnp.bfloat16)
  ref = jax.jit(quant.fp4_main_kv)
  configs = [(1024, 8)] + ([(128, 4), (256, 4), (512, 8), (4096, 8)] if sweep else [])
  kerns = {f"rows={br},warps={nw}": jax.jit(lambda v, br=br, nw=nw: fp4_kernel.fp4_main_kv_pallas(
      v, block_rows=br, num_warps=nw, interpret=interpret)) for br, nw in configs}
  rows = bench_pair("fp4_main_kv", f"[{entries}, {dim}] bf16", ref, kerns, (x,), reps)
  # Independent check on the host: the ml_dtypes float8/float4 casts with the spec's scales.
  import ml_dtypes
  head = np.asarray(x[:4096], np.float32).reshape(-1, 16)
  amax = np.abs(head).max(-1, keepdims=True)
  sc = (np.maximum(amax, np.float32(6 * 2.0 ** -9)) / np.float32(6)).astype(
      ml_dtypes.float8_e4m3fn).astype(np.float32)
  want = (np.clip(head / sc, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * sc)
  want = want.astype(ml_dtypes.bfloat16).astype(np.float32).reshape(-1, dim)
  for label, fn in [("xla", ref), *kerns.items()]:
    try:
      got = np.asarray(fn(x[:4096]), np.float32)
      print(f"host check, {label}: {(got != want).sum()} of {want.size} values differ from "
            "the ml_dtypes casts", flush=True)
    except Exception as e:
      print(f"host check, {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
  return rows


def _hc_inputs(tokens: int, n: int, d: int):
  k = jax.random.split(jax.random.key(2), 4)
  X = jax.random.normal(k[0], (tokens, n, d), jnp.float32).astype(jnp.bfloat16)
  fn = 0.02 * jax.random.normal(k[1], ((2 + n) * n, n * d), jnp.float32)
  base = jax.random.normal(k[2], ((2 + n) * n,), jnp.float32)
  scale = jnp.ones((3,), jnp.float32)
  return X, fn, base, scale


def hc_case(tokens: int, n: int, d: int, interpret: bool, sweep: bool, reps: int):
  args = _hc_inputs(tokens, n, d)
  ref = jax.jit(lambda *a: mhc.hc_coefficients(*a, **HC))
  configs = [(64, 64, 4, 3)]
  if sweep:
    configs += [(32, 64, 4, 3), (64, 32, 4, 4), (128, 64, 4, 3), (64, 64, 2, 3), (64, 128, 4, 3)]
  kerns = {f"tok={bt},k={bk},warps={nw},stages={ns}": jax.jit(
      lambda *a, bt=bt, bk=bk, nw=nw, ns=ns: mhc_kernel.hc_coefficients_pallas(
          *a, **HC, block_tokens=bt, block_k=bk, num_warps=nw, num_stages=ns,
          interpret=interpret)) for bt, bk, nw, ns in configs}
  return bench_pair("hc_coefficients", f"X [{tokens}, {n}, {d}] bf16", ref, kerns, args, reps)


def hc_grad_case(tokens: int, n: int, d: int, interpret: bool, reps: int):
  args = _hc_inputs(tokens, n, d)
  w = [jax.random.normal(jax.random.key(9 + i), s, jnp.float32)
       for i, s in enumerate([(tokens, n), (tokens, n), (tokens, n, n)])]

  def grad_of(f):
    def loss(*a):
      return sum(jnp.sum(wi * oi) for wi, oi in zip(w, f(*a, **HC)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  kern = lambda *a, **kw: mhc_kernel.hc_coefficients(*a, **kw, interpret=interpret)  # noqa: E731
  return bench_pair("hc_coefficients fwd+bwd", f"X [{tokens}, {n}, {d}] bf16",
                    grad_of(mhc.hc_coefficients), {"(reference VJP)": grad_of(kern)}, args, reps)


HEADER = ("| kernel | shape | impl | ms | min bytes moved | GB/s | of 4.3 TB/s | speed-up vs xla | "
          "max abs diff vs xla |\n|---|---|---|---|---|---|---|---|---|")


def row_md(row) -> str:
  name, shape, impl, ms, moved, ratio, diff = row
  if ms is None:
    return f"| {name} | {shape} | {impl} | — | — | — | — | — | — |"
  gbs = moved / ms / 1e6
  return (f"| {name} | {shape} | {impl} | {ms:.3f} | {moved / 2**20:.1f} MiB | {gbs:.0f} | "
          f"{gbs / COPY_CEILING_GBS:.0%} | {'—' if ratio is None else f'{ratio:.2f}×'} | "
          f"{'—' if diff is None else f'{diff:.2e}'} |")


def _log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (CPU)")
  p.add_argument("--sweep", action="store_true", help="also time a few other block sizes")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--entries", type=int, default=1 << 20, help="main-KV rows for fp4_main_kv")
  p.add_argument("--tokens", type=int, default=16384, help="tokens for hc_coefficients")
  p.add_argument("--hidden", type=int, default=5120)
  p.add_argument("--hc-mult", type=int, default=4)
  p.add_argument("--cases", default="fp4,hc,hc_grad", help="comma list of fp4, hc, hc_grad")
  a = p.parse_args(argv)
  interpret = a.smoke or jax.default_backend() == "cpu"
  if a.smoke:
    a.entries, a.tokens, a.hidden, a.reps = 256, 64, 64, 2
  dev = jax.devices()[0]
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {dev.device_kind}, "
        f"kernels {'interpreted' if interpret else 'compiled (Triton, explicit CompilerParams)'}\n")
  cases = {
      "fp4": lambda: fp4_case(a.entries, 512, interpret, a.sweep, a.reps),
      "hc": lambda: hc_case(a.tokens, a.hc_mult, a.hidden, interpret, a.sweep, a.reps),
      "hc_grad": lambda: hc_grad_case(a.tokens, a.hc_mult, a.hidden, interpret, a.reps),
  }
  print(HEADER, flush=True)
  rows = []
  for name in a.cases.split(","):
    for row in cases[name]():
      rows.append(row)
      print(row_md(row), flush=True)
  failed = [r for r in rows if r[3] is None]
  bad_fp4 = [r for r in rows if r[0] == "fp4_main_kv" and r[6] not in (None, 0.0)]
  if failed or bad_fp4:
    print(f"\n{len(failed)} implementation(s) failed; {len(bad_fp4)} FP4 row(s) not bit-exact")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
