"""Train-step time (compile seconds, step seconds, tokens/s) of real configs on this host, and the
memory plan of Flash on a 512-device mesh (analytic: it cannot compile here).

  python benchmarks/step_time.py                        # tiny and small:s1 (batch 2 × seq 256)
  python benchmarks/step_time.py --only=tiny --steps=5
  python benchmarks/step_time.py --only=plan            # the Flash plan only
  JAX_PLATFORMS=cuda python benchmarks/step_time.py --only=s1 --batch=16 --seq=1024   # not run yet

Each config runs the same jitted, donated train step as launch.train (launch.step) on one device,
on random packed rows (one document per row), after a compile whose time is reported separately;
tokens/s counts every row token. `--images` gives the rows the data pipeline's (empty) image
slots, so the ViT runs over them as in a multimodal run; without it the rows are text-only.
MFU = tokens/s × model FLOPs per token (dsv41_jax.flops) / the device's peak (launch.metrics).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX_PLATFORMS=cuda for a GPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import header  # noqa: E402
from configs import flash, small, tiny  # noqa: E402
from configs.common import MeshConfig  # noqa: E402
from dsv41_jax import flops, model as model_lib  # noqa: E402
from launch import aot, metrics as metrics_lib, setup  # noqa: E402


def random_batch(run: setup.RunConfig, B: int, seed: int = 0, images: bool = False) -> dict:
  """Host rows of one document each (no Engram ids: the batch adapter adds them)."""
  T = run.data.seq_len
  rng = np.random.default_rng(seed)
  tok = rng.integers(3, run.model.vocab_size, (B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  batch = {"image_mask": np.zeros((B, T), bool)}
  if images:
    shapes = setup.abstract_batch(run.model, run.data, B)
    batch = {k: np.zeros(v.shape, v.dtype) for k, v in shapes.items() if k != "engram_ids"}
  batch.update(tokens=tok, targets=np.roll(tok, -1, 1), loss_mask=np.ones((B, T), bool),
               segment_ids=seg, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)))
  if "image_starts" in batch:
    batch["image_starts"][:] = -1
  return batch


def step_time(name: str, cfg: ml_collections.ConfigDict, steps: int, images: bool = False) -> dict:
  """The train step of `launch.setup` (state, adapter, jit) on one device."""
  run = setup.run_config(cfg, process_count=1)
  mcfg = run.model
  B, T = run.data.batch_size, run.data.seq_len
  mesh = setup.build_mesh(MeshConfig(data=1), jax.devices()[:1])
  state = setup.init_state(run, mesh)
  # A stand-in compression map (ids modulo the table): the cost is the same as the tokenizer's.
  cmap = np.arange(mcfg.vocab_size) % mcfg.engram_compressed_vocab_size
  batch = setup.BatchAdapter(mcfg, run.data, mesh, cmap)(random_batch(run, B, images=images))
  train_vit = True  # the ViT-trainable program (the larger one; what this benchmark always timed)
  t0 = time.perf_counter()
  compiled = setup.compile_train_steps(setup.train_step_jit(run, state), mesh, [train_vit],
                                       (state.state, batch))[train_vit]
  compile_s = time.perf_counter() - t0
  arrays, m = compiled(state.state, batch)  # warm-up
  jax.block_until_ready(m["loss"])
  t0 = time.perf_counter()
  for _ in range(steps):
    arrays, m = compiled(arrays, batch)
  jax.block_until_ready(m["loss"])
  dt = (time.perf_counter() - t0) / steps
  out = dict(name=name, params=model_lib.param_count(arrays.params), batch=B, seq=T,
             compile_s=compile_s, step_s=dt, tokens_per_s=B * T / dt, loss=float(m["loss"]),
             model_flops_per_token=flops.train_flops_per_token(mcfg.replace(seq_len=T)))
  achieved = out["tokens_per_s"] * out["model_flops_per_token"]
  peak = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind, 0.0)
  out["mfu"] = None if peak is None else achieved / peak
  mfu = "" if peak is None else f", MFU {out['mfu']:.2%} of {peak / 1e12:.0f} TFLOP/s"
  print(f"{name} on {jax.devices()[0].device_kind}: {out['params'] / 1e6:.1f} M params, batch {B} "
        f"× {T}{' (+ image slots)' if images else ''}: compile {compile_s:.1f} s, step {dt:.3f} s, "
        f"{out['tokens_per_s']:,.0f} tokens/s, loss {out['loss']:.3f}, model "
        f"{achieved / 1e9:.2f} GFLOP/s{mfu}", flush=True)
  return out


def flash_plan() -> str:
  cfg = flash.get_config()
  lines = []
  for mesh, rules in [("fsdp:8,expert:8,engram:8", None),
                      ("fsdp:8,expert:8,engram:8", "engram_rows=engram+fsdp+expert"),
                      ("fsdp:8,expert:8,engram:4,tensor:2",
                       "engram_rows=engram+fsdp+expert+tensor")]:
    _, _, text = aot.plan(cfg, mesh, batch=512, seq_len=4096, rules_text=rules, analytic=True,
                          name="configs/flash.py" + (f" (rules {rules})" if rules else ""))
    lines.append(text)
  out = "\n\n".join(lines)
  print(out, flush=True)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", choices=["tiny", "s1", "plan"], default=None)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--batch", type=int, default=2, help="s1 rows per step")
  ap.add_argument("--seq", type=int, default=256, help="s1 sequence length")
  ap.add_argument("--images", action="store_true", help="rows with (empty) image slots")
  args = ap.parse_args()
  print(header(), flush=True)
  if args.only in (None, "plan"):
    flash_plan()
  if args.only in (None, "tiny"):
    step_time("tiny", tiny.get_config(), args.steps, args.images)
  if args.only in (None, "s1"):
    cfg = small.get_config("s1")
    cfg.data.batch_size, cfg.data.seq_len = args.batch, args.seq
    cfg.model.seq_len = args.seq
    step_time("small:s1", cfg, args.steps, args.images)


if __name__ == "__main__":
  main()
