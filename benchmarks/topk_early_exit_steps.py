"""How many digit reductions the Triton select's early exit needs a row, on indexer-like scores (CPU, numpy).

  python benchmarks/topk_early_exit_steps.py [--n 4096 --k 256 --heads 16 --dim 128 --stride 97]

`pallas_kernels.topk_triton.triton_topk(early_exit=True)` finds τ, the need-th largest key, one
bit a reduction from the top and stops once exactly `need` keys reach the prefix (1-bit form:
32 reductions a row without the exit). This restates that loop in numpy over the rows of
I = Σ_h w_h ReLU(q_h · k) (float32, Gaussian q, w, k: the indexer's form, causal visibility,
one row every `--stride` positions), checks τ against a sort, and prints the reductions a row
needs (mean, min, max; rows past k, where every row holds more than k visible entries). It
counts steps only; the time a step takes on a GPU is `benchmarks/csa2_kernels_gpu.py --cases topk-4k`.
"""

from __future__ import annotations

import argparse

import numpy as np

_MIN = -(2 ** 31)


def int_keys(x: np.ndarray) -> np.ndarray:
  """The select's int32 keys (signed order = the floats' total order), as int64."""
  b = x.astype(np.float32).view(np.int32).astype(np.int64)
  return np.where(b >= 0, b, b ^ 0x7FFFFFFF)


def early_exit_steps(keys: np.ndarray, need: int) -> tuple[int, int]:
  """(reductions, τ) of the 1-bit early-exit loop for one row of int32 keys (as int64)."""
  u, reach, steps = 0, len(keys), 0
  while steps < 32 and reach != need:
    cand = u | (1 << (31 - steps))                      # an unsigned prefix; its key is cand + MIN
    count = int(np.sum(keys >= cand + _MIN))
    if count >= need:
      u, reach = cand, count
    steps += 1
  return steps, int(keys[keys >= u + _MIN].min())


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=4096, help="entries (and query rows)")
  ap.add_argument("--k", type=int, default=256)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--dim", type=int, default=128)
  ap.add_argument("--stride", type=int, default=97, help="one query row every STRIDE positions")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  rng = np.random.default_rng(args.seed)
  rows = np.arange(0, args.n, args.stride)
  q = rng.standard_normal((len(rows), args.heads, args.dim)).astype(np.float32)
  w = rng.standard_normal((len(rows), args.heads)).astype(np.float32)
  k = rng.standard_normal((args.n, args.dim)).astype(np.float32)
  scores = np.einsum("th,thn->tn", w, np.maximum(np.einsum("thi,ni->thn", q, k), 0)).astype(
      np.float32)
  steps = []
  for i, t in enumerate(rows):
    visible = np.arange(args.n) <= t
    keys = np.where(visible, int_keys(scores[i]), _MIN)
    need = min(int(visible.sum()), args.k)
    n_steps, tau = early_exit_steps(keys, need)
    assert tau == np.sort(keys)[-need], (t, tau)        # the need-th largest key
    steps.append(n_steps)
  steps = np.array(steps)
  past = steps[rows >= args.k]
  print(f"N {args.n}, top-{args.k}, {args.heads} heads x {args.dim}, {len(rows)} rows: "
        f"{steps.mean():.1f} reductions a row (min {steps.min()}, max {steps.max()}), "
        f"{past.mean():.1f} past row {args.k}; 32 without the early exit")


if __name__ == "__main__":
  main()
