"""Grouped GEMM on the GPU: Mosaic GPU kernels vs capacity-padded batched matmul vs ragged_dot.

  timeout 185 python -u benchmarks/moe_gpu.py --out=$OUT   # H200: everything below, one call
  JAX_PLATFORMS=cpu python benchmarks/moe_gpu.py --smoke   # CPU: tiny shapes, kernels interpreted

Cases (docs/design.md §T7; configs/small.py:s3), bf16 operands, skewed routings:
- `§7`: 64 experts, 16,384 tokens × top-6 = 98,304 rows, 1536 -> 768 (one expert weight).
- `s3 up` / `s3 down`: 48 experts, 16,384 tokens × top-4 = 65,536 rows (1 % padding rows in no
  group), 1024 -> 512 and 512 -> 1024.
- `s3 routed experts`: `moe_dispatch.routed_experts` (dropless, three grouped GEMMs + SwiGLU) with
  the op policy "auto" (the kernels on a Hopper GPU) vs "reference" (`ragged_dot`) vs capacity
  (factor 1.25).

Methods: `mgpu` = `pallas_kernels.grouped_matmul` (forward f32 out, input grad and weight grad bf16
out; each product's block config picked from a small sweep on §7 in this run, reused for the s3
shapes, then fwd+bwd timed with the picks); `capacity` = einsum "ecd,edf->ecf" over [E, C, D] with C = the largest group (what exact
capacity needs); `ragged_dot` = `jax.lax.ragged_dot` and its own VJP.
TFLOP/s count useful FLOPs only: 2·rows·K·N forward, 3× that forward+backward.
Exactness (GPU, fresh random data): each product against `ragged_dot` on float32 copies at
Precision.HIGHEST; the gradients' references use the same bf16 cotangent and are rounded to bf16
like the kernels' outputs. ‖got − ref‖ / ‖ref‖ must be ≤ 1e-5 (forward) and ≤ 1e-3 (gradients).

Imports only jax/numpy and this repository (runs on the GPU image without the data stack).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import elapsed, header, log, md_header, median_seconds  # noqa: E402
from dsv41_jax.layers import moe_dispatch  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
F32 = jnp.float32


def skewed_sizes(rng, rows: int, experts: int, spread: float, empty: int = 2) -> np.ndarray:
  """Log-normal expert popularity (a hot expert ≈ 5-6× the mean at spread 0.9), `empty` unused."""
  p = np.exp(spread * rng.standard_normal(experts))
  p[rng.choice(experts, empty, replace=False)] = 0.0
  return rng.multinomial(rows, p / p.sum()).astype(np.int32)


def _rel(got, ref) -> float:
  got, ref = jnp.asarray(got, F32), jnp.asarray(ref, F32)
  return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def _references(x, w, dy, sizes, capacity: int):
  """float32 HIGHEST products of the bf16 data via a [E, C, ·] buffer (an independent dense form;
  XLA's ragged_dot in float32 took ~40 s here on the H200): y, dx and dw (both bf16-rounded)."""
  e = w.shape[0]
  ends = jnp.cumsum(sizes)
  c = jnp.arange(capacity)
  live = c[None, :] < sizes[:, None]                                     # [E, C]
  idx = jnp.where(live, (ends - sizes)[:, None] + c[None, :], 0)
  pad = lambda a: jnp.where(live[..., None], a.astype(F32)[idx], 0.0)    # [E, C, ·]
  xp, dyp, wf = pad(x), pad(dy), w.astype(F32)
  yp = jnp.einsum("eck,ekn->ecn", xp, wf, precision=HIGHEST)
  dxp = jnp.einsum("ecn,ekn->eck", dyp, wf, precision=HIGHEST)
  dw = jnp.einsum("eck,ecn->ekn", xp, dyp, precision=HIGHEST)
  rows = jnp.where(live, idx, x.shape[0]).reshape(-1)                     # row x.shape[0] = drop
  unpad = lambda ap: jnp.zeros((x.shape[0], ap.shape[-1]), F32).at[rows].set(
      ap.reshape(e * capacity, -1), mode="drop")
  return unpad(yp), unpad(dxp).astype(x.dtype), dw.astype(w.dtype)


def grouped_case(name, rows, k, n, sizes_np, plans, reps, smoke, results):
  """One grouped-GEMM shape: sweep the kernels' configs, check, time against the baselines."""
  e = len(sizes_np)
  keys = jax.random.split(jax.random.key(hash(name) % 2**31), 4)
  x = jax.random.normal(keys[0], (rows, k), F32).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[1], (e, k, n), F32) / np.sqrt(k)).astype(jnp.bfloat16)
  r = jax.random.normal(keys[2], (rows, n), F32)
  sizes = jnp.asarray(sizes_np)
  flops = 2.0 * float(sizes_np.sum()) * k * n
  shape_txt = (f"{rows} rows ({int(sizes_np.sum())} in groups), {k}->{n}, E={e}, groups "
               f"min/mean/max {sizes_np.min()}/{sizes_np.mean():.0f}/{sizes_np.max()}")
  log(f"{name}: {shape_txt}")
  row = dict(case=name, shape=shape_txt, useful_gflop_fwd=flops / 1e9)
  results.append(row)
  ref_y, ref_dx, ref_dw = jax.jit(_references, static_argnums=4)(
      x, w, r.astype(jnp.bfloat16), sizes, int(sizes_np.max()))

  # Per-product sweep: the three products are independent kernels, so each keeps its best config.
  best = {}
  for product in ("forward", "input_grad", "weight_grad"):
    timings = {}
    for label, cfg in plans[product].items():
      plan = dataclasses.replace(gm.Plan(interpret=smoke), **{product: cfg})
      fwd, dxf, dwf = gm.products(plan)
      fn, args, ref = {"forward": (fwd, (x, w, sizes), ref_y),
                       "input_grad": (dxf, (r.astype(jnp.bfloat16), w, sizes), ref_dx),
                       "weight_grad": (dwf, (x, r.astype(jnp.bfloat16), sizes), ref_dw)}[product]
      try:
        fn = jax.jit(fn)
        err = _rel(fn(*args), ref)
        ms = 1e3 * median_seconds(fn, *args, reps=reps)
        timings[label] = dict(ms=ms, tflops=flops / ms / 1e9, rel_err=err, cfg=dataclasses.asdict(cfg))
        log(f"  {product} {label}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s rel err {err:.1e}")
      except Exception as ex:  # a config that does not compile is reported, not fatal
        timings[label] = dict(error=f"{type(ex).__name__}: {str(ex)[:300]}")
        log(f"  {product} {label}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
    row[f"mgpu_{product}_sweep"] = timings
    ok = {lab: t for lab, t in timings.items() if "ms" in t}
    if ok:
      best[product] = min(ok, key=lambda lab: ok[lab]["ms"])
  row["mgpu_best"] = best

  # Forward and forward+backward with the picks, through the custom VJP.
  if len(best) == 3:
    plan = gm.Plan(interpret=smoke, **{p: plans[p][best[p]] for p in best})
    fwd = jax.jit(lambda x, w, s: gm.grouped_matmul(x, w, s, plan))
    loss = lambda x, w, s: jnp.sum(gm.grouped_matmul(x, w, s, plan) * r)
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    try:
      y = fwd(x, w, sizes)
      _, (dx, dw) = fb(x, w, sizes)
      row["mgpu_rel_err"] = dict(y=_rel(y, ref_y), dx=_rel(dx, ref_dx), dw=_rel(dw, ref_dw))
      row["mgpu_exact"] = bool(row["mgpu_rel_err"]["y"] <= 1e-5 and row["mgpu_rel_err"]["dx"] <= 1e-3
                               and row["mgpu_rel_err"]["dw"] <= 1e-3
                               and not any(bool(jnp.isnan(a.astype(F32)).any()) for a in (y, dx, dw)))
      row["mgpu_fwd_ms"] = 1e3 * median_seconds(fwd, x, w, sizes, reps=reps)
      row["mgpu_fwdbwd_ms"] = 1e3 * median_seconds(fb, x, w, sizes, reps=reps)
      log(f"  mgpu fwd {row['mgpu_fwd_ms']:.3f} ms, fwd+bwd {row['mgpu_fwdbwd_ms']:.3f} ms, "
           f"rel err {row['mgpu_rel_err']}")
    except Exception as ex:
      row["mgpu_error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
      traceback.print_exc()

  # Capacity-padded batched matmul with C = the largest group (exact capacity).
  c = int(sizes_np.max())
  xb = jax.random.normal(keys[3], (e, c, k), F32).astype(jnp.bfloat16)
  rb = jax.random.normal(keys[3], (e, c, n), F32)
  bm = jax.jit(lambda xb, w: jnp.einsum("ecd,edf->ecf", xb, w, preferred_element_type=F32))
  bl = lambda xb, w: jnp.sum(jnp.einsum("ecd,edf->ecf", xb, w, preferred_element_type=F32) * rb)
  bfb = jax.jit(jax.value_and_grad(bl, argnums=(0, 1)))
  row["capacity_fwd_ms"] = 1e3 * median_seconds(bm, xb, w, reps=reps)
  row["capacity_fwdbwd_ms"] = 1e3 * median_seconds(bfb, xb, w, reps=reps)
  del xb, rb

  # ragged_dot (XLA) and its own VJP: slow on the GPU (docs/design.md §T7), so few repetitions and
  # only while the run has time left.
  if elapsed() > 120 and not smoke:
    log("  ragged_dot skipped: time budget")
    return
  rd = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=F32))
  rl = lambda x, w, s: jnp.sum(jax.lax.ragged_dot(x, w, s, preferred_element_type=F32) * r)
  rfb = jax.jit(jax.value_and_grad(rl, argnums=(0, 1)))
  row["ragged_dot_fwd_ms"] = 1e3 * median_seconds(rd, x, w, sizes, reps=max(2, reps // 5))
  row["ragged_dot_fwdbwd_ms"] = 1e3 * median_seconds(rfb, x, w, sizes, reps=max(2, reps // 5))
  log(f"  done: { {k: round(v, 3) for k, v in row.items() if k.endswith('_ms')} }")


def routed_experts_case(tokens, d, f, e, k, reps, smoke, results):
  """s3's routed experts through `moe_dispatch.routed_experts`, forward and forward+backward."""
  rng = np.random.default_rng(7)
  keys = jax.random.split(jax.random.key(11), 5)
  x = jax.random.normal(keys[0], (1, tokens, d), F32).astype(jnp.bfloat16)
  pop = np.exp(0.9 * rng.standard_normal(e))
  experts = np.stack([rng.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(tokens)])
  experts = jnp.asarray(experts.reshape(1, tokens, k), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 0.5, (1, tokens, k)), F32)
  valid = jnp.ones((1, tokens), bool)
  w1, w3 = ((jax.random.normal(kk, (e, d, f), F32) / np.sqrt(d)) for kk in keys[1:3])
  w2 = jax.random.normal(keys[3], (e, f, d), F32) / np.sqrt(f)
  ct = jax.random.normal(keys[4], (1, tokens, d), F32)
  flops = 3 * 2.0 * tokens * k * d * f
  row = dict(case="s3 routed experts", shape=f"{tokens} tokens × top-{k}, d={d}, f={f}, E={e}",
             useful_gflop_fwd=flops / 1e9,
             impl_auto=dispatch.choose("grouped_matmul", "auto", x[0], w1.astype(x.dtype),
                                       jnp.full((e,), tokens * k // e, jnp.int32))[0])
  results.append(row)
  log(f"routed experts: {row['shape']} (auto -> {row['impl_auto']})")
  outs = {}
  for label, kw in (("dropless auto", dict(mode="dropless", policy="auto")),
                    ("dropless ragged_dot", dict(mode="dropless", policy="reference")),
                    ("capacity 1.25", dict(mode="capacity", capacity_factor=1.25))):
    fn = lambda x, w1, w3, w2, kw=kw: moe_dispatch.routed_experts(
        x, weights, experts, valid, w1, w3, w2, **kw)[0]
    fwd = jax.jit(fn)
    fb = jax.jit(jax.value_and_grad(lambda *a, fn=fn: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3)))
    try:
      outs[label] = (fwd(x, w1, w3, w2), fb(x, w1, w3, w2)[1])
      n = max(2, reps // 5) if "ragged" in label else reps
      row[f"{label} fwd ms"] = 1e3 * median_seconds(fwd, x, w1, w3, w2, reps=n)
      row[f"{label} fwd+bwd ms"] = 1e3 * median_seconds(fb, x, w1, w3, w2, reps=n)
      row[f"{label} fwd+bwd TFLOP/s"] = 3 * flops / row[f"{label} fwd+bwd ms"] / 1e9
      log(f"  {label}: fwd {row[f'{label} fwd ms']:.3f} ms, fwd+bwd {row[f'{label} fwd+bwd ms']:.3f} ms")
    except Exception as ex:
      row[f"{label} error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
      traceback.print_exc()
  if "dropless auto" in outs and "dropless ragged_dot" in outs:
    (ya, ga), (yr, gr) = outs["dropless auto"], outs["dropless ragged_dot"]
    row["auto vs ragged_dot rel err"] = dict(
        y=_rel(ya, yr), **{f"d{n}": _rel(a, b) for n, a, b in zip(("x", "w1", "w3", "w2"), ga, gr)})
    log(f"  auto vs ragged_dot: {row['auto vs ragged_dot rel err']}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, kernels interpreted")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  dev = jax.devices()[0]
  print(header(), flush=True)
  log(f"cc {getattr(dev, 'compute_capability', '-')}, SMs {getattr(dev, 'core_count', '-')}")
  T = gm.TileConfig
  if args.smoke:
    c = T(64, 64, 64, 2, 1)
    plans = {p: {"64x64x64 s2": c} for p in ("forward", "input_grad", "weight_grad")}
    reps = 1
  else:
    plans = {
        "forward": {"128x128x64 s4 band2": T(128, 128, 64, 4, 2),
                    "128x128x64 s4 band1": T(128, 128, 64, 4, 1),
                    "128x128x128 s2 band2": T(128, 128, 128, 2, 2)},
        "input_grad": {"128x128x64 s5 band2": T(128, 128, 64, 5, 2),
                       "128x128x64 s6 band2": T(128, 128, 64, 6, 2),
                       "128x128x64 s4 band1": T(128, 128, 64, 4, 1)},
        "weight_grad": {"128x128x64 s4": T(128, 128, 64, 4, 1),
                        "128x128x64 s6": T(128, 128, 64, 6, 1),
                        "128x128x128 s3": T(128, 128, 128, 3, 1)},
    }
    reps = args.reps
  results = []
  signal.signal(signal.SIGTERM, _interrupt)  # `timeout` ends the run: still write and print
  try:
    run_cases(plans, reps, args.smoke, results, args.out)
  except KeyboardInterrupt:
    log("interrupted: writing what was measured")
  finally:
    report(results, dev, args.out)


def _interrupt(*_):
  raise KeyboardInterrupt


def run_cases(plans, reps, smoke, results, out):
  rng = np.random.default_rng(0)
  # (name, rows, K, N, experts, padding rows in no group, routing spread); smoke: tiny.
  # Spread 1.2 gives §7 a hot expert of 8,786 rows (mean 1,536), like docs/design.md §T7's routing.
  cases = ([("§7", 16384 * 6, 1536, 768, 64, 0, 1.2), ("s3 up", 16384 * 4, 1024, 512, 48, 655, 0.9),
            ("s3 down", 16384 * 4, 512, 1024, 48, 655, 0.9)] if not smoke else
           [("§7", 384, 128, 128, 8, 0, 1.2), ("s3 up", 256, 128, 64, 6, 9, 0.9)])
  for name, rows, k, n, e, pad, spread in cases:
    if elapsed() > 150:
      log(f"skipping {name}: time budget")
      continue
    sizes = skewed_sizes(rng, rows - pad, e, spread)
    try:
      grouped_case(name, rows, k, n, sizes, plans, reps, smoke, results)
    except Exception as ex:
      results.append(dict(case=name, error=f"{type(ex).__name__}: {str(ex)[:300]}"))
      traceback.print_exc()
    report(results, jax.devices()[0], out)  # what is measured survives a killed run
    best = results[-1].get("mgpu_best", {})
    if len(best) == 3:  # later shapes reuse §7's picks (one compile per product, not three)
      plans = {p: {lab: plans[p][lab]} for p, lab in best.items()}
  if elapsed() < 160:
    try:
      routed_experts_case(*((16384, 1024, 512, 48, 4) if not smoke else (128, 128, 64, 8, 4)),
                          reps, smoke, results)
    except Exception as ex:
      results.append(dict(case="s3 routed experts", error=f"{type(ex).__name__}: {str(ex)[:300]}"))
      traceback.print_exc()


def report(results, dev, out):
  """Write every figure to out/moe_gpu.json and print the compact table."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "moe_gpu.json"), "w") as fh:
    json.dump(dict(jax=jax.__version__, device=str(dev), results=results), fh, indent=1,
              default=str)
  print("\n" + md_header("case", "method", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                         "rel err y/dx/dw"))
  fmt = lambda v, p=3: "—" if v is None else f"{v:.{p}f}"
  for row in results:
    if "mgpu_best" not in row:
      continue
    for m in ("mgpu", "capacity", "ragged_dot"):
      for p, mult in (("fwd", 1), ("fwdbwd", 3)):
        if f"{m}_{p}_ms" in row:
          row[f"{m}_{p}_tflops"] = mult * row["useful_gflop_fwd"] / row[f"{m}_{p}_ms"]
    for m in ("mgpu", "capacity", "ragged_dot"):
      err = row.get("mgpu_rel_err") if m == "mgpu" else None
      err_txt = "—" if err is None else "/".join(f"{err[q]:.1e}" for q in ("y", "dx", "dw"))
      print(f"| {row['case']} | {m} | {fmt(row.get(f'{m}_fwd_ms'))} | "
            f"{fmt(row.get(f'{m}_fwd_tflops'), 0)} | {fmt(row.get(f'{m}_fwdbwd_ms'))} | "
            f"{fmt(row.get(f'{m}_fwdbwd_tflops'), 0)} | {err_txt} |")
    print(f"|  | picks: {row['mgpu_best']}; exact: {row.get('mgpu_exact')} |  |  |  |  |  |")
  for row in results:
    if "error" in row or "mgpu_error" in row:
      print("ERROR", row["case"], row.get("error") or row.get("mgpu_error"))
    if row["case"] == "s3 routed experts":
      print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
  log("done")


if __name__ == "__main__":
  main()
