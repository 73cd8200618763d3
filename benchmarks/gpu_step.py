"""Train step of the small configs on one GPU: init, compile, step time, MFU, memory, and where the
step goes (model forward+backward, optimizer, host batch preparation).

  PYTHONUNBUFFERED=1 python benchmarks/gpu_step.py --sizes s1 s3 --seq 4096 --batch 8 4
  python benchmarks/gpu_step.py --sizes s1 s1/noremat --batch 8   # remat on vs off
  python benchmarks/gpu_step.py --sizes s3 s3/saves=projections+experts --batch 4 4  # what remat keeps
  python benchmarks/gpu_step.py --sizes s3 s3 --batch 4 --grad_accum 1 8 --sinkhorn --muon_precision
  python benchmarks/gpu_step.py --sizes s3 --batch 4 --set model.ops.hc_site=reference \
      model.ops.hc_coefficients=reference            # one config key changed for every size

Per size: the model and optimizer state are created with their shardings (`launch.setup.init_state`,
timed to ready), the jitted donated train step (`launch.setup.train_step_jit`) is lowered and
compiled ahead of time (timed), then run `--steps` times on random packed rows (several documents
per row, Engram ids hashed on the host by the training batch adapter, `launch.setup.BatchAdapter`);
the median step is reported. Variants of one size (remat on / off / what it keeps) reuse the last
variant's state rather than creating it again; "program GiB" is the compiled step's own memory
(XLA's memory analysis), since the allocator's peak spans the whole process. The split
compiles two more programs from the same pieces: the model's forward+backward alone
(`jax.value_and_grad` of the objective) and the optimizer update alone (`tx.update` +
`apply_updates` on those gradients); "host" is the batch adapter's work on rows without Engram ids
(hashing, device transfer; in training the hashing runs in the data pipeline, per piece).
MFU = tokens/s × `dsv41_jax.flops.train_flops_per_token` / 989 TFLOP/s (H200 dense bf16,
`launch.metrics`). Peak memory is the device allocator's peak.

`--grad_accum K` (one per size, like `--batch`): `--batch` rows are one micro-batch and the step
covers K of them (`train.grad_accum_steps`, a global batch of batch × K rows); the optimizer's
share of such a step is the split's optimizer time (the same program at every K: a run of the same
size without accumulation measures it) over the step time. `--sinkhorn` times the Sinkhorn
direction of every Engram table alone (`optim.sinkhorn.sinkhorn_direction` on its gradient, with
its sub-table layout); `--muon_precision` prints `benchmarks/muon_precision.real_gradient_rows` of
the split's real gradients (both need the split).
Prints one line per size as it goes and a markdown table at the end; `--json PATH` saves them.

`--turn DIR:N`: N processes (arms of an A/B, each its own `--set` or its own copy of the tree) that
share DIR build their state and compile at once, then time their steps (and the split) one at a
time (`benchmarks.common.Turns`: each waits for the live arms' compiles, at most `--turn_wait` s),
so no arm's timed steps share the GPU or the host with another's work. Two s3 arms should then cost
about one arm's init + compile plus both arms' steps (not yet measured on the GPU). Give each
process its share of the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 for two); its compile
seconds include the host time the others' compiles took from it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import xla_flags  # noqa: E402

xla_flags.apply_defaults()   # as launch.train does, before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import muon_precision  # noqa: E402
from benchmarks.common import (Turns, header, md_header, median_seconds,  # noqa: E402
                               set_overrides)
from configs import small  # noqa: E402
from configs.common import MeshConfig  # noqa: E402
from dsv41_jax import flops, model as model_lib  # noqa: E402
from dsv41_jax.loss import objective  # noqa: E402
from launch import metrics as metrics_lib, setup  # noqa: E402
from launch.step import engram_sub_tables, model_inputs  # noqa: E402
from optim import table as table_lib  # noqa: E402
from optim.sinkhorn import sinkhorn_direction  # noqa: E402


def packed_rows(mcfg, B: int, T: int, seed: int) -> dict[str, np.ndarray]:
  """Random rows of 2–5 documents each (positions restart per document), no padding."""
  rng = np.random.default_rng(seed)
  tok = rng.integers(3, mcfg.vocab_size, (B, T)).astype(np.int32)
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), rng.integers(1, 5), replace=False))
    bounds = np.concatenate([[0], cuts, [T]])
    for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[b, lo:hi] = d + 1
      pos[b, lo:hi] = np.arange(hi - lo)
  loss_mask = np.roll(seg, -1, 1) == seg
  loss_mask[:, -1] = False
  return dict(tokens=tok, targets=np.roll(tok, -1, 1), loss_mask=loss_mask, segment_ids=seg,
              positions=pos, image_mask=np.zeros((B, T), bool))


# The last state of each (size, rows, seq, overrides), reused by the next variant of it (`bench`).
_STATES: dict = {}


def bench(spec: str, B: int, T: int, steps: int, split: bool, profile_dir: str | None = None,
          accum: int = 1, sinkhorn: bool = False, precision: bool = False,
          overrides: tuple[str, ...] = (), timed=contextlib.nullcontext, images: bool = False,
          train_vit: bool = False) -> dict:
  """`spec` is a size of configs/small.py, optionally "/noremat" (no layer rematerialisation) or
  "/saves=projections+experts" (what layer remat keeps besides its fixed set, `model.remat_saves`);
  `B` rows per micro-batch, `accum` micro-batches per step; `overrides` "key=value" items of the
  config (`benchmarks.common.set_overrides`), applied before the benchmark's own settings;
  `timed()` wraps the steps (and the split's timings: `Turns.turn`). `images`: the model keeps its
  ViT and the batch is the data pipeline's first (its rows, images and image slots as
  `launch.train` gets them, on the default corpus) instead of random text rows; `train_vit` picks
  the ViT-trainable program (the phase after the decay starts) over the frozen one."""
  size, _, variant = spec.partition("/")
  cfg = small.get_config(size)
  set_overrides(cfg, overrides)
  if variant == "noremat":
    cfg.model.remat = False
  elif variant.startswith("saves="):
    cfg.model.remat_saves = tuple(s for s in variant[len("saves="):].split("+") if s)
  elif variant:
    raise SystemExit(f"error: size {spec!r}: the variant is noremat or saves=A+B")
  cfg.data.seq_len, cfg.data.batch_size = T, B * accum
  cfg.train.grad_accum_steps = accum
  cfg.model.seq_len = T
  if not images:
    cfg.model.vision = None  # text rows: the ViT is frozen for most of a run (a separate program)
  cfg.optim.frozen, cfg.optim.unfreeze_at = (), "never"
  run = setup.run_config(cfg, process_count=1)
  mcfg = run.model
  dev = jax.devices()[0]
  mesh = setup.build_mesh(MeshConfig(data=1), [dev])
  out: dict = dict(size=spec, batch=B * accum, accum=accum, seq=T, device=dev.device_kind,
                   jax=jax.__version__, dispatch=mcfg.moe_dispatch, remat=mcfg.remat,
                   remat_saves=list(mcfg.remat_saves),
                   dtype=mcfg.dtype, overrides=list(overrides), images=images,
                   train_vit=bool(images and train_vit))

  t0 = time.perf_counter()
  key = (size, B * accum, T, overrides)  # the state does not depend on the remat variant
  train_state = _STATES.pop(key, None)
  if train_state is None:
    train_state = setup.init_state(run, mesh)
  else:  # the module graph holds the config: this variant's, over the kept arrays
    train_state = dataclasses.replace(
        train_state, graphdef=nnx.split(model_lib.abstract_model(mcfg))[0])
  jax.block_until_ready(train_state.state)
  out["init_s"] = time.perf_counter() - t0
  graphdef, tx = train_state.graphdef, train_state.tx
  out["params"] = model_lib.param_count(train_state.state.params)
  print(f"[{spec}] {out['params'] / 1e9:.2f} B params, init {out['init_s']:.1f} s", flush=True)

  # The training batch adapter, with a stand-in compression map (ids modulo the table).
  adapter = setup.BatchAdapter(mcfg, run.data, mesh,
                               np.arange(mcfg.vocab_size) % mcfg.engram_compressed_vocab_size)
  t0 = time.perf_counter()
  if images:
    from data.pipeline import make_train_iterator
    rows = next(make_train_iterator(run.data, vocab_size=mcfg.vocab_size))
    out["image_slots"] = int(np.prod(rows["images"].shape[:2]))
    out["images_filled"] = int(np.sum(rows["image_count"]))
    print(f"[{spec}] the pipeline's first batch: {out['images_filled']} images in "
          f"{out['image_slots']} slots", flush=True)
  else:
    rows = packed_rows(mcfg, B * accum, T, 0)
  batch = adapter(rows)
  jax.block_until_ready(batch)
  out["host_prepare_s"] = time.perf_counter() - t0

  step = setup.train_step_jit(run, train_state)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = step.lower(train_state.state, batch, train_vit if images else True)
    out["lower_s"] = time.perf_counter() - t0
    compiled = lowered.compile()
  out["compile_s"] = time.perf_counter() - t0 - out["lower_s"]
  mem = compiled.memory_analysis()
  if mem is not None:  # this program's own need (the allocator's peak spans the process)
    out["program_gib"] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                          + mem.output_size_in_bytes - mem.alias_size_in_bytes) / 2**30
    print(f"[{spec}] program memory {out['program_gib']:.1f} GiB "
          f"(temporaries {mem.temp_size_in_bytes / 2**30:.1f})", flush=True)
  print(f"[{spec}] trace+lower {out['lower_s']:.1f} s, compile {out['compile_s']:.1f} s", flush=True)

  with timed():
    state = train_state.state
    losses, times = [], []
    for i in range(steps + 1):
      t0 = time.perf_counter()
      state, m = compiled(state, batch)
      losses.append(float(m["loss"]))
      times.append(time.perf_counter() - t0)
    out["step_s"] = float(np.median(times[1:]))
    if profile_dir:  # two more steps under the profiler; benchmarks/trace_summary.py reads them
      os.makedirs(profile_dir, exist_ok=True)
      with open(os.path.join(profile_dir, spec.replace("/", "_") + ".hlo.txt"), "w") as f:
        f.write(compiled.as_text())
      with jax.profiler.trace(os.path.join(profile_dir, spec.replace("/", "_")),
                              create_perfetto_trace=True):
        for _ in range(2):
          state, m = compiled(state, batch)
          float(m["loss"])
    _STATES[key] = dataclasses.replace(train_state, state=state)  # the state after the last step
    out["losses"] = losses
    out["tokens_per_s"] = B * accum * T / out["step_s"]
    out["flops_per_token"] = flops.train_flops_per_token(mcfg.replace(seq_len=T))
    peak = metrics_lib.peak_flops_per_device(dev.device_kind, 0.0) or 989e12
    out["mfu"] = out["tokens_per_s"] * out["flops_per_token"] / peak
    stats = dev.memory_stats() or {}
    out["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    print(f"[{spec}] step {out['step_s'] * 1e3:.1f} ms (median of {steps}), "
          f"{out['tokens_per_s']:,.0f} tok/s, MFU {out['mfu']:.1%}, "
          f"peak {out['peak_gib']:.1f} GiB, losses {losses[0]:.3f} → {losses[-1]:.3f}",
          flush=True)

    if split and accum == 1:
      params, opt_state, bias = state  # the step donated the initial arrays

      def loss_fn(p, batch):
        logits, aux = nnx.merge(graphdef, p)(model_inputs(batch), bias)
        return objective(mcfg, logits, aux, batch)[0]

      fwd_bwd = jax.jit(jax.value_and_grad(loss_fn))
      with jax.set_mesh(mesh):
        fb = fwd_bwd.lower(params, batch).compile()
        _, grads = fb(params, batch)

        def update(g, s, p):
          u, s = tx.update(g, s, p)
          return optax.apply_updates(p, u), s

        upd = jax.jit(update).lower(grads, opt_state, params).compile()
      out["fwd_bwd_s"] = median_seconds(fb, params, batch, reps=steps)
      out["optimizer_s"] = median_seconds(upd, grads, opt_state, params, reps=steps)
      rows_np = packed_rows(mcfg, B, T, 1)  # the adapter's work (hashing, transfer), timed
      out["host_s"] = median_seconds(adapter, rows_np, reps=3)
      print(f"[{spec}] split: forward+backward {out['fwd_bwd_s'] * 1e3:.1f} ms, optimizer "
            f"{out['optimizer_s'] * 1e3:.1f} ms, "
            f"host batch preparation {out['host_s'] * 1e3:.1f} ms",
            flush=True)
      if sinkhorn:
        out["sinkhorn_s"] = time_engram_sinkhorn(run, nnx.merge(graphdef, params), grads)
        print(f"[{spec}] Sinkhorn of the Engram tables: {out['sinkhorn_s'] * 1e3:.1f} ms",
              flush=True)
      if precision:
        rows = muon_precision.real_gradient_rows(grads)
        out["muon_precision"] = rows
        muon_precision.print_rows(rows)
  return out


def time_engram_sinkhorn(run, model, grads) -> float:
  """Median seconds of the Sinkhorn direction of every Engram table together (their gradients as
  the momentum-free Nesterov direction, with each table's sub-table layout), one jitted call."""
  layouts = engram_sub_tables(model)
  flat = dict(table_lib.flatten_params(grads))
  o = run.optim
  fn = jax.jit(lambda gs: [sinkhorn_direction(g, o.sinkhorn_iters, o.sinkhorn_tau, o.sinkhorn_eps,
                                              o.update_rms, layouts[p], o.sinkhorn_stat_dtype)
                          for p, g in gs.items()])
  return median_seconds(fn, {p: flat[p] for p in layouts}, reps=5)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes", nargs="+", default=["s1", "s3"])
  ap.add_argument("--batch", type=int, nargs="+", default=[8, 4])
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--no_split", action="store_true")
  ap.add_argument("--json", default=None)
  ap.add_argument("--profile", default=None, help="directory for a profile of two more steps")
  ap.add_argument("--grad_accum", type=int, nargs="+", default=[1],
                  help="micro-batches per step, one per size (or one for all)")
  ap.add_argument("--sinkhorn", action="store_true", help="time the Engram tables' Sinkhorn")
  ap.add_argument("--muon_precision", action="store_true",
                  help="Newton-Schulz singular values on the split's real gradients")
  ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                  help="config keys for every size, e.g. model.ops.hc_site=reference")
  ap.add_argument("--turn", default=None, metavar="DIR:N",
                  help="N processes sharing DIR compile at once and time in turn (module doc)")
  ap.add_argument("--turn_wait", type=float, default=600.0,
                  help="seconds to wait for the other processes' compiles")
  ap.add_argument("--images", action="store_true",
                  help="the model with its ViT on the data pipeline's first batch (images and all)")
  ap.add_argument("--train_vit", action="store_true",
                  help="with --images: the ViT-trainable program (else the frozen one)")
  args = ap.parse_args()
  turns = Turns(args.turn, args.turn_wait) if args.turn else None
  per_size = lambda v: v if len(v) == len(args.sizes) else v[:1] * len(args.sizes)
  rows = []
  for i, (size, B, k) in enumerate(zip(args.sizes, per_size(args.batch),
                                       per_size(args.grad_accum))):
    timed = (lambda i=i: turns.turn(i)) if turns else contextlib.nullcontext
    rows.append(bench(size, B, args.seq, args.steps, not args.no_split, args.profile, k,
                      args.sinkhorn, args.muon_precision, tuple(args.set), timed,
                      images=args.images, train_vit=args.train_vit))
    opt = [r["optimizer_s"] for r in rows if r["size"] == size and "optimizer_s" in r]
    if opt:
      rows[-1]["optimizer_share"] = opt[0] / rows[-1]["step_s"]
      print(f"[{size}] optimizer share of the step ({k} micro-batches): "
            f"{rows[-1]['optimizer_share']:.1%}", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
  print("\n" + header())
  print(md_header("size", "params", "batch × seq", "micro-batches", "init s", "compile s",
                  "step ms", "tok/s", "MFU", "peak GiB", "fwd+bwd ms", "optimizer ms",
                  "optimizer share", "host ms"))
  for r in rows:
    print(f"| {r['size']} | {r['params'] / 1e9:.2f} B | {r['batch']} × {r['seq']} | {r['accum']} | "
          f"{r['init_s']:.1f} | {r['compile_s']:.1f} | {r['step_s'] * 1e3:.1f} | "
          f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_gib']:.1f} | "
          f"{r.get('fwd_bwd_s', float('nan')) * 1e3:.1f} | "
          f"{r.get('optimizer_s', float('nan')) * 1e3:.1f} | "
          f"{r.get('optimizer_share', float('nan')):.1%} | {r.get('host_s', float('nan')) * 1e3:.1f} |")


if __name__ == "__main__":
  main()
