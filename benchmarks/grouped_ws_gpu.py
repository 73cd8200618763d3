"""Grouped GEMM kernels side by side: one warpgroup vs warp-specialized (issue 27).

  timeout 200 python -u benchmarks/grouped_ws_gpu.py --out=$OUT      # Hopper GPU, ~2 min a case
  JAX_PLATFORMS=cpu python benchmarks/grouped_ws_gpu.py --smoke      # CPU: tiny, interpreted

`pallas_kernels.grouped_matmul`'s forward (bf16 out, as the experts run it: `forward_narrow`),
input gradient and weight gradient, at the in-step shapes of s3 (16,384 tokens x top-4 over 48
experts: 65,536 rows) and m3 (x top-6 over 64: 98,304 rows), skewed routing, 1 % of the rows in
no group:
- `1wg`: the single-warpgroup kernels (`_gmm_kernel`, `_tgmm_kernel`) with the blocks that were
  the row products' default until session 71 (128 x 128 x 64, 6 deep, band 2) and the weight
  gradient's default until session 72 (the same, band 1); `TileConfig.compute_wgs` 1;
- `2wg ...`: the warp-specialized kernels (`_gmm_ws_kernel`, `_tgmm_ws_kernel`: a producer
  warpgroup, two consumers of block_m x block_n each), a few depths and blocks.
Then forward + backward through the custom VJP with every product at `1wg`, with the row products
at their fastest `2wg` config (the weight gradient at `1wg`), and with all three at their fastest
`2wg`. TFLOP/s count useful FLOPs (2·rows·K·N a product); ratios are 2wg / 1wg time. Exactness:
each kernel's output against float32 `ragged_dot` (its VJP for the weight gradient) of the same
bf16 operands rounded to bf16 (‖got − ref‖ / ‖ref‖), and whether 2wg equals 1wg bit for bit.
Imports only jax/numpy and this repository.
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

from benchmarks.common import header, log, md_header, median_seconds  # noqa: E402
from benchmarks.moe_gpu import _rel, skewed_sizes  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST
PRODUCTS = ("forward", "input_grad", "weight_grad")


# The single-warpgroup blocks that were the row products' default until session 71, and the
# weight gradient's until session 72.
ONE_WG = gm.TileConfig(128, 128, 64, 6, 2)
ONE_WG_WEIGHT = gm.TileConfig(128, 128, 64, 6, 1)


def configs(smoke: bool, product: str = "forward"):
  T = gm.TileConfig
  if smoke:
    return {"1wg": T(64, 64, 64, 2, 1), "2wg s2": T(64, 64, 64, 2, 1, compute_wgs=2)}
  if product == "weight_grad":
    return {"1wg": ONE_WG_WEIGHT,
            "2wg 128x2x128 k64 s4": T(128, 128, 64, 4, 1, compute_wgs=2),
            "2wg 128x2x128 k64 s3": T(128, 128, 64, 3, 1, compute_wgs=2),
            "2wg 128x2x64 k64 s6": T(128, 64, 64, 6, 1, compute_wgs=2)}
  return {"1wg": ONE_WG,
          "2wg 128x2x128 k64 s4": T(128, 128, 64, 4, 1, compute_wgs=2),
          "2wg 128x2x128 k128 s2": T(128, 128, 128, 2, 1, compute_wgs=2),
          "2wg 128x2x64 k64 s4": T(128, 64, 64, 4, 1, compute_wgs=2)}


def case(name, rows, k, n, experts, reps, smoke, results, products=PRODUCTS):
  rng = np.random.default_rng(0)
  sizes_np = skewed_sizes(rng, rows - rows // 100, experts, 0.9)
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (rows, k), F32).astype(BF16)
  w = (jax.random.normal(keys[1], (experts, k, n), F32) / np.sqrt(k)).astype(BF16)
  dy = jax.random.normal(keys[2], (rows, n), F32).astype(BF16)
  sizes = jnp.asarray(sizes_np)
  flops = 2.0 * float(sizes_np.sum()) * k * n
  def reference(x, w, dy, s):
    fwd = lambda w: jax.lax.ragged_dot(x, w, s, precision=HIGHEST, preferred_element_type=F32)
    y, vjp = jax.vjp(fwd, w.astype(F32))
    return (y.astype(BF16),
            jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), s, precision=HIGHEST,
                               preferred_element_type=F32).astype(BF16),
            vjp(dy.astype(F32))[0].astype(BF16))

  ref = jax.jit(reference)(x, w, dy, sizes)
  log(f"{name}: {rows} rows ({int(sizes_np.sum())} in groups), {k}->{n}, E={experts}")
  base = gm.Plan(interpret=smoke)
  row = dict(case=name, rows=rows, k=k, n=n, experts=experts, gflop=flops / 1e9)
  results.append(row)
  best = {}
  for product, field, args, want in (("forward", "forward_narrow", (x, w, sizes), ref[0]),
                                     ("input_grad", "input_grad", (dy, w, sizes), ref[1]),
                                     ("weight_grad", "weight_grad", (x, dy, sizes), ref[2])):
    if product not in products:
      continue
    first = None
    for label, cfg in configs(smoke, product).items():
      plan = dataclasses.replace(base, **{field: cfg})
      fwd, dxf, dwf = gm.products(plan)
      fn = jax.jit((lambda a, b, s, f=fwd: f(a, b, s, out_dtype=BF16)) if product == "forward"
                   else dxf if product == "input_grad" else dwf)
      key = f"{product} {label}"
      try:
        why = gm.unsupported_reason(x, w, plan)
        if why:
          raise ValueError(why)
        out = fn(*args)
        ms = 1e3 * median_seconds(fn, *args, reps=reps)
        same = None if first is None else bool(jnp.array_equal(out, first))
        first = out if first is None else first
        row[key] = dict(ms=ms, tflops=flops / ms / 1e9, rel_err=_rel(out, want), bitwise_1wg=same)
        log(f"  {key}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s rel err {row[key]['rel_err']:.1e}"
            f" bitwise=1wg {same}")
        if label != "1wg" and (product not in best or ms < best[product][1]):
          best[product] = (cfg, ms)
      except Exception as ex:
        _stop_if_asked()
        row[key] = dict(error=f"{type(ex).__name__}: {str(ex)[:400]}")
        log(f"  {key}: FAILED {row[key]['error']}")
        if not smoke:
          traceback.print_exc()
  # Forward + backward through the custom VJP: every product single-warpgroup, the row products
  # at their fastest 2wg (the weight gradient single-warpgroup), and all three at their fastest.
  r = jax.random.normal(keys[2], (rows, n), F32).astype(BF16)
  cfg1, cfg1_w = configs(smoke)["1wg"], configs(smoke, "weight_grad")["1wg"]
  plans = {"1wg": dataclasses.replace(base, forward_narrow=cfg1, input_grad=cfg1,
                                      weight_grad=cfg1_w)}
  # A product not measured here takes the plan's default (the smoke run: its 2wg config).
  two = configs(smoke)["2wg s2"] if smoke else None
  default = gm.Plan() if not smoke else gm.Plan(forward_narrow=two, input_grad=two)
  pick = lambda product, field: best.get(product, (getattr(default, field),))[0]
  plans["2wg rows"] = dataclasses.replace(plans["1wg"], forward_narrow=pick("forward",
                                                                           "forward_narrow"),
                                          input_grad=pick("input_grad", "input_grad"))
  if "weight_grad" in best:
    plans["2wg"] = dataclasses.replace(plans["2wg rows"], weight_grad=best["weight_grad"][0])
  grads = {}
  for label, plan in plans.items():
    loss = lambda x, w, plan=plan: jnp.sum(
        (gm.grouped_matmul(x, w, sizes, plan, out_dtype=BF16) * r).astype(F32))
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    try:
      grads[label] = fb(x, w)[1]
      ms = 1e3 * median_seconds(fb, x, w, reps=reps)
      row[f"fwd+bwd {label}"] = dict(ms=ms, tflops=3 * flops / ms / 1e9)
      log(f"  fwd+bwd {label}: {ms:.3f} ms {3 * flops / ms / 1e9:.0f} TFLOP/s")
    except Exception as ex:
      _stop_if_asked()
      row[f"fwd+bwd {label}"] = dict(error=f"{type(ex).__name__}: {str(ex)[:400]}")
      log(f"  fwd+bwd {label}: FAILED {row[f'fwd+bwd {label}']['error']}")
  for label in grads:
    if label != "1wg" and "1wg" in grads:
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(grads["1wg"], grads[label]))
      row[f"fwd+bwd grads bitwise {label}"] = same
      log(f"  fwd+bwd gradients {label} == 1wg bit for bit: {same}")


_STOP = []


def _interrupt(*_):
  _STOP.append(True)   # an interrupt that lands in a callback thread surfaces as a runtime error
  raise KeyboardInterrupt


def _stop_if_asked():
  if _STOP:
    raise KeyboardInterrupt


def _write(out, results):
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "grouped_ws_gpu.json"), "w") as fh:
    json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), results=results), fh,
              indent=1, default=str)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
  ap.add_argument("--products", default=",".join(PRODUCTS),
                  help=f"comma-separated, of {','.join(PRODUCTS)}")
  args = ap.parse_args()
  products = tuple(p for p in args.products.split(",") if p)
  unknown = set(products) - set(PRODUCTS)
  if unknown:
    ap.error(f"--products: unknown {sorted(unknown)}; known: {list(PRODUCTS)}")
  print(header(), flush=True)
  results = []
  cases = ([("s3_gate_up", 65536, 1024, 1024, 48), ("s3_down", 65536, 512, 1024, 48),
            ("m3_gate_up", 98304, 1536, 1536, 64), ("m3_down", 98304, 768, 1536, 64)]
           if not args.smoke else [("tiny", 256, 128, 128, 6)])
  if args.cases:
    wanted = args.cases.split(",")
    missing = set(wanted) - {c[0] for c in cases}
    if missing:
      ap.error(f"--cases: unknown {sorted(missing)}; known: {[c[0] for c in cases]}")
    cases = [c for c in cases if c[0] in wanted]
  signal.signal(signal.SIGTERM, _interrupt)   # `timeout` ends the run: keep what was measured
  try:
    for c in cases:
      try:
        case(*c, 1 if args.smoke else args.reps, args.smoke, results, products)
      except Exception as ex:
        _stop_if_asked()
        results.append(dict(case=c[0], error=f"{type(ex).__name__}: {str(ex)[:400]}"))
        traceback.print_exc()
      _write(args.out, results)
  except KeyboardInterrupt:
    log("interrupted: writing what was measured")
  _write(args.out, results)
  print("\n" + md_header("case", "product", "config", "ms", "TFLOP/s", "ratio to 1wg", "rel err",
                         "bitwise = 1wg"))
  for row in results:
    for key, v in row.items():
      if not isinstance(v, dict) or "ms" not in v:
        continue
      product = "fwd+bwd" if key.startswith("fwd+bwd") else key.split(" ", 1)[0]
      label = key[len(product) + 1:]
      base = row.get(f"{product} 1wg", {}).get("ms")
      ratio = "—" if not base else f"{v['ms'] / base:.3f}"
      err = "—" if "rel_err" not in v else f"{v['rel_err']:.1e}"
      print(f"| {row['case']} | {product} | {label} | {v['ms']:.3f} | {v['tflops']:.0f} | {ratio} |"
            f" {err} | {v.get('bitwise_1wg', '—')} |")
  log("done")


if __name__ == "__main__":
  main()
