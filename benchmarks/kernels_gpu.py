"""Pallas kernels vs their XLA references on one GPU, side by side (docs/design.md §T5).

  python benchmarks/kernels_gpu.py                       # H200: full-size shapes, markdown table
  python benchmarks/kernels_gpu.py --sweep               # also try a few block sizes per kernel
  python benchmarks/kernels_gpu.py --cases=quant --entries=262144   # a subset, smaller
  python benchmarks/kernels_gpu.py --smoke               # CPU: tiny shapes, kernels interpreted

For each kernel the same inputs go through the XLA reference (the model's pure function under
`jax.jit`) and the Pallas kernel; the table gives the median wall time of `--reps` calls, the bytes
each call must move at least (inputs read once + outputs written once), the achieved GB/s and its
fraction of the device-to-device copy rate measured in the same run (`copy` row: x -> x + 1 on
2 GiB, bytes read + written), the speed-up (XLA ms / Pallas ms) and the largest difference
between the two outputs (the fake quants must be 0). `--budget-s` stops starting new cases once
that many seconds have passed, so one device call always ends with the table; `--json` writes
every row there too.

Cases:
- `quant`: FP4 main-KV, MXFP4 and FP8 SWA fake quantization of [entries, 512] bf16 (docs/design.md §9.2),
  forward (the backward is the straight-through identity). Also checked on the host against the
  ml_dtypes casts with the spec's scales.
- `site`: one single-pass mHC site (`hc_site`: previous expand + coefficients + collapse + norm,
  docs/design.md §3.3) and its kernels: `pallas_kernels.mhc.hc_site` (the Sinkhorn gates in Triton;
  `--sweep` adds 64-token gate blocks) and the registered `pallas_kernels.mhc_rows.hc_site` (two
  Triton stream passes, session 69), n = 4, bf16 streams, at d = 5120 / 4096 and 8K–32K tokens;
  forward, and forward+backward (`jax.vjp` with given cotangents). Minimum traffic: (2n+2)·d
  values per token forward, plus (3n+3)·d backward (X, F, dX', dx read; dX, dF written). The
  model's streams are float32: benchmarks/mhc_moe_gpu.py times the site at s3's shapes that way.
- `hc`: the coefficients alone, `hc_coefficients` and its kernel (X [tokens, 4, 5120]).

Imports only jax/numpy and this repository, so it runs on the GPU machine without the data stack.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import elapsed, header, log, md_header, median_seconds  # noqa: E402
from dsv41_jax import quant  # noqa: E402
from dsv41_jax.layers import mhc  # noqa: E402
from pallas_kernels import fake_quant as fq_kernel  # noqa: E402
from pallas_kernels import mhc as mhc_kernel, mhc_rows  # noqa: E402

HC = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)
COPY = {"gbs": 4300.0, "source": "docs/design.md §T5 (not measured in this run)"}


def _max_diff(a, b) -> float:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in zip(leaves_a, leaves_b))


def _nbytes(*trees) -> int:
  return sum(int(x.size) * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t))


def bench_pair(name, shape_txt, ref_fn, kern_fns, args, reps, moved=None):
  """Rows for one case: the XLA reference and each Pallas variant (label -> fn)."""
  rows = []
  log(f"{name} {shape_txt}: xla reference")
  try:
    ref_out = ref_fn(*args)
    moved = moved or _nbytes(args, ref_out)
    ref_ms = 1e3 * median_seconds(ref_fn, *args, reps=reps)
    rows.append((name, shape_txt, "xla", ref_ms, moved, None, 0.0))
  except Exception as e:  # keep going: a failing case is reported, not fatal
    rows.append((name, shape_txt, f"xla FAILED: {type(e).__name__}: {str(e)[:200]}", None, 0, None,
                 None))
    traceback.print_exc()
    return rows
  for label, fn in kern_fns.items():
    log(f"{name} {shape_txt}: pallas {label}")
    try:
      out = fn(*args)
      diff = _max_diff(out, ref_out)
      ms = 1e3 * median_seconds(fn, *args, reps=reps)
      rows.append((name, shape_txt, f"pallas {label}", ms, moved, ref_ms / ms, diff))
    except Exception as e:
      rows.append((name, shape_txt, f"pallas {label} FAILED: {type(e).__name__}: {str(e)[:300]}",
                   None, moved, None, None))
      traceback.print_exc()
  return rows


def copy_case(reps: int, size: int = 1 << 30):
  """The copy ceiling: x -> x + 1 over 2 GiB of bf16 (bytes read + written)."""
  x = jnp.ones((size,), jnp.bfloat16)
  ms = 1e3 * median_seconds(jax.jit(lambda v: v + 1), x, reps=reps)
  moved = 2 * x.size * 2
  COPY.update(gbs=moved / ms / 1e6, source="measured in this run (x + 1 on 2 GiB bf16)")
  return [("copy", "[2^30] bf16", "xla x+1", ms, moved, None, None)]


def _blocky(entries: int, dim: int, key: int):
  x = jax.random.normal(jax.random.key(key), (entries, dim), jnp.float32)
  # Block magnitudes e^-8 .. e^5: subnormal E4M3 scales up to amax ≈ 800 < 2688 (no saturation).
  mag = jnp.exp(jnp.clip(2.0 * jax.random.normal(jax.random.key(key + 1), (entries, dim // 16, 1)),
                         -8, 5))
  return (x.reshape(entries, dim // 16, 16) * mag).reshape(entries, dim).astype(jnp.bfloat16)


def quant_case(entries: int, interpret: bool, sweep: bool, reps: int):
  import ml_dtypes
  x = _blocky(entries, 512, 0)
  configs = [(1024, 8), (512, 4)] + ([(2048, 8), (256, 4), (4096, 8)] if sweep else [])
  rows = []
  for fmt, ref in [("fp4_main_kv", quant.fp4_main_kv), ("mxfp4", quant.mxfp4),
                   ("fp8_swa", quant.fp8_swa)]:
    kerns = {f"rows={br},warps={nw}": jax.jit(functools.partial(
        fq_kernel.fake_quant_pallas, fmt=fmt, block_rows=br, num_warps=nw, interpret=interpret))
        for br, nw in configs}
    ref = jax.jit(ref)
    rows += bench_pair(f"fake quant {fmt}", f"[{entries}, 512] bf16", ref, kerns, (x,), reps)
    # Independent check on the host: the ml_dtypes casts with the spec's scales (§9.2).
    head = np.asarray(x[:2048], np.float32)
    b = fq_kernel.BLOCK[fmt]
    hb = head.reshape(-1, b)
    amax = np.abs(hb).max(-1, keepdims=True)
    if fmt == "fp4_main_kv":
      sc = np.minimum(np.maximum(amax, np.float32(6 * 2.0 ** -9)) / np.float32(6), 448)
      sc = sc.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
      want = np.clip(hb / sc, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * sc
    else:
      top, floor, dt = ((6.0, 6 * 2.0 ** -126, ml_dtypes.float4_e2m1fn) if fmt == "mxfp4"
                        else (448.0, 1e-4, ml_dtypes.float8_e4m3fn))
      sc = np.exp2(np.ceil(np.log2(np.maximum(amax.astype(np.float64), floor) / top)))
      want = (np.clip(hb / sc, -top, top).astype(dt).astype(np.float64) * sc).astype(np.float32)
    want = want.astype(ml_dtypes.bfloat16).astype(np.float32).reshape(head.shape)
    for label, fn in [("xla", ref), *kerns.items()]:
      try:
        got = np.asarray(fn(x[:2048]), np.float32)
        print(f"host check {fmt}, {label}: {(got != want).sum()} of {want.size} values differ "
              "from the ml_dtypes casts", flush=True)
      except Exception as e:
        print(f"host check {fmt}, {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
  return rows


def _site_inputs(tokens: int, n: int, d: int):
  k = jax.random.split(jax.random.key(2), 9)
  X = jax.random.normal(k[0], (tokens, n, d), jnp.float32).astype(jnp.bfloat16)
  F = jax.random.normal(k[1], (tokens, d), jnp.float32).astype(jnp.bfloat16)
  post = 2.0 * jax.random.uniform(k[2], (tokens, n))
  comb = mhc.sinkhorn_project(2.0 * jax.random.normal(k[3], (tokens, n, n)), 20, 1e-6)
  pre = jax.random.uniform(k[4], (tokens, n), minval=0.05, maxval=1.0)
  fn = 0.02 * jax.random.normal(k[5], ((2 + n) * n, n * d), jnp.float32)
  base = jax.random.normal(k[6], ((2 + n) * n,), jnp.float32)
  scale = jnp.ones((3,), jnp.float32)
  w = 1.0 + 0.1 * jax.random.normal(k[7], (d,), jnp.float32)
  return X, F, post, comb, pre, fn, base, scale, w


def site_case(tokens: int, n: int, d: int, interpret: bool, sweep: bool, reps: int):
  args = _site_inputs(tokens, n, d)
  ref = jax.jit(functools.partial(mhc.hc_site, **HC))
  kerns = {f"gate blocks of {bt} tokens": jax.jit(functools.partial(
      mhc_kernel.hc_site, **HC, block_tokens=bt, interpret=interpret))
      for bt in ((16, 64) if sweep else (16,))}
  kerns["rows (registered)"] = jax.jit(functools.partial(mhc_rows.hc_site, **HC,
                                                         interpret=interpret))
  moved = (2 * n + 2) * d * 2 * tokens  # X, F read; X', x written (bf16); coefficients ≪
  return bench_pair("mhc site fwd", f"[{tokens}, {n}, {d}] bf16", ref, kerns, args, reps, moved)


def site_grad_case(tokens: int, n: int, d: int, interpret: bool, reps: int):
  args = _site_inputs(tokens, n, d)
  outs = jax.eval_shape(functools.partial(mhc.hc_site, **HC), *args)
  cts = tuple(jax.random.normal(jax.random.key(20 + i), o.shape, jnp.float32).astype(o.dtype)
              for i, o in enumerate(outs))

  def fwd_bwd(site):
    def run(*a):
      out, vjp = jax.vjp(functools.partial(site, **HC), *a)
      return out, vjp(cts)
    return jax.jit(run)

  kern = functools.partial(mhc_kernel.hc_site, interpret=interpret)
  moved = ((2 * n + 2) + (3 * n + 3)) * d * 2 * tokens
  return bench_pair("mhc site fwd+bwd", f"[{tokens}, {n}, {d}] bf16", fwd_bwd(mhc.hc_site),
                    {"gates kernel + Sinkhorn-recompute bwd": fwd_bwd(kern),
                     "rows (registered)": fwd_bwd(functools.partial(mhc_rows.hc_site,
                                                                    interpret=interpret))},
                    args, reps, moved)


def hc_case(tokens: int, n: int, d: int, interpret: bool, reps: int):
  X, _, _, _, _, fn, base, scale, _ = _site_inputs(tokens, n, d)
  ref = jax.jit(lambda *a: mhc.hc_coefficients(*a, **HC))
  kern = jax.jit(lambda *a: mhc_kernel.hc_coefficients(*a, **HC, interpret=interpret))
  return bench_pair("hc_coefficients", f"X [{tokens}, {n}, {d}] bf16", ref, {"default": kern},
                    (X, fn, base, scale), reps)


HEADER = md_header("kernel", "shape", "impl", "ms", "min bytes moved", "GB/s", "of copy",
                   "speed-up vs xla", "max abs diff vs xla")


def row_md(row) -> str:
  name, shape, impl, ms, moved, ratio, diff = row
  if ms is None:
    return f"| {name} | {shape} | {impl} | — | — | — | — | — | — |"
  gbs = moved / ms / 1e6
  return (f"| {name} | {shape} | {impl} | {ms:.3f} | {moved / 2**20:.1f} MiB | {gbs:.0f} | "
          f"{gbs / COPY['gbs']:.0%} | {'—' if ratio is None else f'{ratio:.2f}×'} | "
          f"{'—' if diff is None else f'{diff:.2e}'} |")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (CPU)")
  p.add_argument("--sweep", action="store_true", help="also time a few other block sizes")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--entries", type=int, default=1 << 20, help="rows of 512 for the fake quants")
  p.add_argument("--site-shapes", default="16384x5120,32768x4096,8192x5120",
                 help="tokens x d for the forward site rows (the first also gets fwd+bwd)")
  p.add_argument("--cases", default="copy,quant,site,site_grad,site_more",
                 help="comma list of copy, quant, site (first shape), site_grad (first shape), "
                 "site_more (the other shapes), hc")
  p.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this")
  p.add_argument("--json", default="", help="also write all rows (and the copy rate) here")
  a = p.parse_args(argv)
  interpret = a.smoke or jax.default_backend() == "cpu"
  shapes = [tuple(int(v) for v in s.split("x")) for s in a.site_shapes.split(",")]
  if a.smoke:
    a.entries, a.reps, shapes = 256, 2, [(48, 64)]
  dev = jax.devices()[0]
  print(header())
  print(f"kernels {'interpreted' if interpret else 'compiled (Triton, explicit CompilerParams)'}\n")
  cases = {
      "copy": [lambda: copy_case(a.reps, 1 << (16 if a.smoke else 30))],
      "quant": [lambda: quant_case(a.entries, interpret, a.sweep, a.reps)],
      "site": [lambda: site_case(*shapes[0][:1], 4, shapes[0][1], interpret, a.sweep, a.reps)],
      "site_more": [lambda t=t, d=d: site_case(t, 4, d, interpret, False, a.reps)
                    for t, d in shapes[1:]],
      "site_grad": [lambda: site_grad_case(shapes[0][0], 4, shapes[0][1], interpret, a.reps)],
      "hc": [lambda: hc_case(shapes[0][0], 4, shapes[0][1], interpret, a.reps)],
  }
  rows = []
  for name in a.cases.split(","):
    for case in cases[name]:
      if elapsed() > a.budget_s:
        log(f"budget of {a.budget_s:.0f} s spent: skipping the rest of {name}")
        continue
      new = case()
      rows += new
      for row in new:  # as we go, in case the call is cut short
        print(row_md(row), flush=True)
  print(f"\ncopy rate used for 'of copy': {COPY['gbs']:.0f} GB/s, {COPY['source']}\n")
  print(HEADER)
  for row in rows:
    print(row_md(row))
  if a.json:
    import json
    with open(a.json, "w") as f:
      json.dump({"copy": COPY, "rows": rows, "jax": jax.__version__, "device": dev.device_kind},
                f, indent=1)
  failed = [r for r in rows if r[3] is None]
  bad_quant = [r for r in rows if r[0].startswith("fake quant") and r[6] not in (None, 0.0)]
  if failed or bad_quant:
    print(f"\n{len(failed)} implementation(s) failed; {len(bad_quant)} fake-quant row(s) not "
          "bit-exact")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
