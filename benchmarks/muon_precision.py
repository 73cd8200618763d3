"""Newton–Schulz in float32 vs the bfloat16 iterate (float32 accumulation): singular values of the
orthogonalized direction and the update RMS after Muon's rescaling (docs/design.md §T2: 0.18).

  python benchmarks/muon_precision.py [--shapes 1024x512 512x128 1536x768 768x1536]
  (real gradients) benchmarks/gpu_step.py --muon_precision, which calls `real_gradient_rows`

Synthetic inputs are gradient-like matrices: Gaussian with a decaying spectrum (singular values
spread over four decades). Real inputs are the gradients of a model's train objective on packed
rows, every Muon-group parameter (the optimizer table's rows), up to `per_shape` matrices of each
distinct shape (a first-step Nesterov direction is a multiple of the gradient, and Newton–Schulz is
scale-free). The direction goes through `optim.muon.orthogonalize_many`, the optimizer's batched
path, at both precisions; singular values are taken in float64 with numpy. Targets (issue 25):
σ within 1 ± 5e-3, update RMS within 1 % of 0.18.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import header, md_header  # noqa: E402
from optim import table  # noqa: E402
from optim.muon import muon_direction, orthogonalize_many  # noqa: E402

UPDATE_RMS = 0.18


def gradient_like(rng, m: int, n: int) -> np.ndarray:
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  s = np.logspace(0, -4, k)
  return (u * s) @ v.T


def _spectrum_row(name: str, o: np.ndarray, rows: int, cols: int, ns_dtype: str) -> dict:
  sv = np.linalg.svd(o, compute_uv=False)
  d = o * UPDATE_RMS * max(rows, cols) ** 0.5
  rms = float(np.sqrt(np.mean(d ** 2)))
  return dict(name=name, precision=ns_dtype, sv_min=float(sv.min()), sv_max=float(sv.max()),
              rms=rms, rms_ratio=rms / UPDATE_RMS)


def real_gradient_rows(grads, per_shape: int = 2) -> list[dict]:
  """Singular values and update RMS of the orthogonalized real gradients: up to `per_shape`
  matrices of every distinct matrix shape among the Muon-group parameters of `grads`."""
  rows = table.label_params(grads)
  picked: dict[tuple, list[tuple[str, np.ndarray]]] = {}
  for path, g in table.flatten_params(grads):
    row = rows[path]
    if row.group != "muon":
      continue
    mats = jnp.moveaxis(g, -2, -3) if row.headwise else jnp.asarray(g)   # stays on the device
    mats = mats.reshape(-1, *mats.shape[-2:])
    key = tuple(mats.shape[-2:])
    for k in range(mats.shape[0]):
      if len(picked.setdefault(key, [])) >= per_shape:
        break
      if bool(jnp.any(mats[k] != 0)):
        picked[key].append((f"{path}[{k}]", np.asarray(mats[k], np.float32)))
  out = []
  items = [it for v in picked.values() for it in v]
  for ns_dtype in ("float32", "bfloat16"):
    orth = jax.jit(lambda xs: orthogonalize_many(xs, [False] * len(xs), ns_dtype))(
        [x for _, x in items])
    for (name, x), o in zip(items, orth):
      out.append(_spectrum_row(name, np.asarray(o, np.float64), *x.shape, ns_dtype))
  return out


def print_rows(rows: list[dict]) -> None:
  print(md_header("matrix", "precision", "σ min", "σ max", "update RMS", "RMS / 0.18"))
  for r in rows:
    print(f"| {r['name']} | {r['precision']} | {r['sv_min']:.4f} | {r['sv_max']:.4f} | "
          f"{r['rms']:.5f} | {r['rms_ratio']:.4f} |", flush=True)
  # A gradient of lower rank than its shape keeps its zero singular values (in any precision):
  # such matrices (float32 σ min < 0.5) are summarized apart.
  deficient = {r["name"] for r in rows if r["precision"] == "float32" and r["sv_min"] < 0.5}
  for p in ("float32", "bfloat16"):
    sel = [r for r in rows if r["precision"] == p and r["name"] not in deficient]
    if sel:
      print(f"{p}: σ in [{min(r['sv_min'] for r in sel):.4f}, {max(r['sv_max'] for r in sel):.4f}]"
            f", RMS / 0.18 in [{min(r['rms_ratio'] for r in sel):.4f}, "
            f"{max(r['rms_ratio'] for r in sel):.4f}] over {len(sel)} full-rank matrices",
            flush=True)
  if deficient:
    print(f"rank-deficient gradients (zero singular values kept, RMS below 0.18 in both "
          f"precisions): {sorted(deficient)}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", nargs="+", default=["1024x512", "512x128", "1536x768", "768x1536"])
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  rng = np.random.default_rng(args.seed)
  print(header())
  print(md_header("shape", "precision", "σ min", "σ max", "update RMS", "RMS / 0.18"))
  for shape in args.shapes:
    m, n = (int(x) for x in shape.split("x"))
    g = gradient_like(rng, m, n).astype(np.float32)
    for ns_dtype in ("float32", "bfloat16"):
      d = np.asarray(jax.jit(lambda x: muon_direction(x, False, UPDATE_RMS, ns_dtype))(g),
                     np.float64)
      sv = np.linalg.svd(d / (UPDATE_RMS * max(m, n) ** 0.5), compute_uv=False)
      rms = float(np.sqrt(np.mean(d ** 2)))
      print(f"| {m}×{n} | {ns_dtype} | {sv.min():.4f} | {sv.max():.4f} | {rms:.5f} | "
            f"{rms / UPDATE_RMS:.4f} |", flush=True)


if __name__ == "__main__":
  main()
