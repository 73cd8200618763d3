"""Newton–Schulz in float32 vs bfloat16 operands (float32 accumulation): singular-value spread of
the orthogonalized direction and the update RMS after Muon's rescaling (docs/design.md §T2: 0.18).

  python benchmarks/muon_precision.py [--shapes 1024x512 512x128 1536x768 768x1536]

Inputs are gradient-like matrices: Gaussian with a decaying spectrum (singular values spread over
four decades, as real gradients are far from isotropic). The direction goes through
`optim.muon.muon_direction` at both precisions; singular values are taken in float64 with numpy.
Prints a markdown table; the figures do not depend on the device (the bfloat16 rounding of the
operands is the same everywhere), so this runs on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import header, md_header  # noqa: E402
from optim.muon import muon_direction  # noqa: E402

UPDATE_RMS = 0.18


def gradient_like(rng, m: int, n: int) -> np.ndarray:
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  s = np.logspace(0, -4, k)
  return (u * s) @ v.T


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
