"""Newton–Schulz in float32 vs the bfloat16 iterate (float32 accumulation), for each schedule
(`optim.muon.NS_SCHEDULES`: the spec's 8 + 2 steps, Polar Express's 8 per-step quintics): singular
values of the orthogonalized direction and the update RMS after Muon's rescaling (docs/design.md
§T2: 0.18), and each schedule's steps and matrix products.

  python benchmarks/muon_precision.py [--shapes 1024x512 512x128 1536x768 768x1536]
      [--gaussian 512x1024] [--schedules spec polar_express] [--real tiny]
  (real gradients on a GPU) benchmarks/gpu_step.py --muon_precision, which calls `real_gradient_rows`

Synthetic inputs: gradient-like matrices (Gaussian with a decaying spectrum, singular values spread
over four decades, `--shapes`) and plain Gaussian ones (`--gaussian`, 4 of each shape). Real inputs
are the gradients of a model's train objective on packed rows, every Muon-group parameter (the
optimizer table's rows), up to `per_shape` matrices of each distinct shape (a first-step Nesterov
direction is a multiple of the gradient, and Newton–Schulz is scale-free): `--real CONFIG` takes
them on this machine from `configs/CONFIG.py` (`tiny`, `tiny:micro`, `small:s1`, ...) at its
initialization on random packed rows, as gpu_step does for its sizes. The direction goes through
`optim.muon.orthogonalize_many`, the optimizer's batched path, at both precisions; singular values
are taken in float64 with numpy. Targets (issue 25): σ within 1 ± 5e-3, update RMS within 1 % of
0.18.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import header, md_header  # noqa: E402
from optim import table  # noqa: E402
from optim.muon import NS_SCHEDULES, orthogonalize_many  # noqa: E402

UPDATE_RMS = 0.18


def gradient_like(rng, m: int, n: int) -> np.ndarray:
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  s = np.logspace(0, -4, k)
  return (u * s) @ v.T


def _spectrum_row(name: str, o: np.ndarray, rows: int, cols: int, ns_dtype: str,
                  ns_schedule: str) -> dict:
  sv = np.linalg.svd(o, compute_uv=False)
  d = o * UPDATE_RMS * max(rows, cols) ** 0.5
  rms = float(np.sqrt(np.mean(d ** 2)))
  return dict(name=name, schedule=ns_schedule, precision=ns_dtype, sv_min=float(sv.min()),
              sv_max=float(sv.max()), rms=rms, rms_ratio=rms / UPDATE_RMS)


def spectrum_rows(items: list[tuple[str, np.ndarray]], schedules=tuple(NS_SCHEDULES)) -> list[dict]:
  """`_spectrum_row` of every named matrix, orthogonalized together by `orthogonalize_many`, for
  each schedule at both precisions."""
  out = []
  for ns_schedule in schedules:
    for ns_dtype in ("float32", "bfloat16"):
      orth = jax.jit(lambda xs: orthogonalize_many(xs, [False] * len(xs), ns_dtype,
                                                   ns_schedule=ns_schedule))([x for _, x in items])
      for (name, x), o in zip(items, orth):
        out.append(_spectrum_row(name, np.asarray(o, np.float64), *x.shape, ns_dtype, ns_schedule))
  return out


def real_gradient_rows(grads, per_shape: int = 2, schedules=tuple(NS_SCHEDULES)) -> list[dict]:
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
  return spectrum_rows([it for v in picked.values() for it in v], schedules)


def config_gradients(spec: str, batch: int = 4):
  """The train objective's gradients of `configs/<module>.py[:arg]` at its initialization, on
  `batch` random packed rows (benchmarks/gpu_step.py's `packed_rows`), on this machine."""
  from flax import nnx
  from benchmarks.gpu_step import packed_rows
  from configs.common import MeshConfig
  from dsv41_jax.loss import objective
  from launch import setup
  from launch.step import model_inputs
  module, _, arg = spec.partition(":")
  cfg = importlib.import_module(f"configs.{module}").get_config(arg or None)
  cfg.model.vision = None  # text rows
  cfg.optim.frozen, cfg.optim.unfreeze_at = (), "never"
  run = setup.run_config(cfg, process_count=1)
  mcfg = run.model
  mesh = setup.build_mesh(MeshConfig(data=1), jax.devices()[:1])
  train_state = setup.init_state(run, mesh)
  params, _, bias = train_state.state
  adapter = setup.BatchAdapter(mcfg, run.data, mesh,
                               np.arange(mcfg.vocab_size) % mcfg.engram_compressed_vocab_size)
  rows = adapter(packed_rows(mcfg, batch, run.data.seq_len, 0))

  def loss_fn(p):
    logits, aux = nnx.merge(train_state.graphdef, p)(model_inputs(rows), bias)
    return objective(mcfg, logits, aux, rows)[0]

  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss_fn))(params)


def print_rows(rows: list[dict]) -> None:
  print(md_header("matrix", "schedule", "precision", "σ min", "σ max", "update RMS", "RMS / 0.18"))
  for r in rows:
    print(f"| {r['name']} | {r['schedule']} | {r['precision']} | {r['sv_min']:.4f} | "
          f"{r['sv_max']:.4f} | {r['rms']:.5f} | {r['rms_ratio']:.4f} |", flush=True)
  # A gradient of lower rank than its shape keeps its zero singular values (in any precision and
  # schedule): such matrices (σ min < 0.5 in float32 under the first schedule) are summarized apart.
  first = rows[0]["schedule"]
  deficient = {r["name"] for r in rows
               if r["schedule"] == first and r["precision"] == "float32" and r["sv_min"] < 0.5}
  for sch in dict.fromkeys(r["schedule"] for r in rows):
    for p in ("float32", "bfloat16"):
      sel = [r for r in rows
             if r["schedule"] == sch and r["precision"] == p and r["name"] not in deficient]
      if sel:
        print(f"{sch}, {p}: σ in [{min(r['sv_min'] for r in sel):.4f}, "
              f"{max(r['sv_max'] for r in sel):.4f}], RMS / 0.18 in "
              f"[{min(r['rms_ratio'] for r in sel):.4f}, {max(r['rms_ratio'] for r in sel):.4f}]"
              f" over {len(sel)} matrices full-rank in float32 under {first}", flush=True)
  if deficient:
    print(f"rank-deficient gradients (zero singular values kept, RMS below 0.18 in both "
          f"precisions): {sorted(deficient)}", flush=True)


def print_schedules(shapes: list[tuple[int, int]]) -> None:
  """Steps, products and FLOP per matrix of each schedule: a step is three products on the short
  side k = min(m, n) (Gram 2k²l, its square 2k³, the product with X 2k²l; l = max(m, n))."""
  print(md_header("schedule", "steps", "products per matrix",
                  *(f"GFLOP per {m}×{n}" for m, n in shapes)))
  for name, sch in NS_SCHEDULES.items():
    steps = len(sch.coeffs)
    flop = [steps * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3) / 1e9 for m, n in shapes]
    print("| " + " | ".join([name, str(steps), str(3 * steps), *(f"{f:.3f}" for f in flop)]) + " |",
          flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", nargs="*", default=["1024x512", "512x128", "1536x768", "768x1536"])
  ap.add_argument("--gaussian", nargs="*", default=["512x1024"])
  ap.add_argument("--schedules", nargs="+", default=list(NS_SCHEDULES), choices=list(NS_SCHEDULES))
  ap.add_argument("--real", default=None, metavar="CONFIG",
                  help="also real gradients of configs/CONFIG.py (e.g. tiny, tiny:micro, small:s1)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  rng = np.random.default_rng(args.seed)
  dims = lambda shape: tuple(int(x) for x in shape.split("x"))
  print(header())
  print_schedules([dims(s) for s in args.gaussian + args.shapes])
  items = [(f"Gaussian {m}×{n} [{k}]", rng.standard_normal((m, n)).astype(np.float32))
           for m, n in map(dims, args.gaussian) for k in range(4)]
  items += [(f"spectrum over 4 decades {m}×{n}", gradient_like(rng, m, n).astype(np.float32))
            for m, n in map(dims, args.shapes)]
  if items:
    print_rows(spectrum_rows(items, args.schedules))
  if args.real:
    print_rows(real_gradient_rows(config_gradients(args.real), schedules=args.schedules))


if __name__ == "__main__":
  main()
