"""What `train.unfilled_buffers` takes out of a config's train step, read on the CPU (no GPU needed).

  python benchmarks/zero_fills.py --size s3 --batch 4 --seq 4096 --accum 8 \
      [--set model.cast_weights_once=false]

Lowers the train step for CUDA (`lowering_platforms=("cuda",)`, the CPU's op forms) with
`launch.unfilled_buffers` installed three ways (scan stacks only, switch slots only, both) and
prints the bytes of the AllocateBuffers that replace jax's zero fills, the largest by shape; then
the train step's `lax.cond`s with many outputs (the CSA2 kind switch), each branch's bytes of
outputs that are its own inputs (what a branch still copies as residuals). Bytes are per
occurrence in the program: a fill inside the micro-batch loop runs once a micro-batch.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_BYTES = dict(f64=8, i64=8, ui64=8, f32=4, i32=4, ui32=4, bf16=2, f16=2, i16=2, ui16=2, i8=1,
              ui8=1, i1=1)


def tensor_bytes(shape_text: str) -> int:
  """Bytes of a StableHLO tensor type's body, e.g. '10x4x4096xbf16'."""
  *dims, dtype = shape_text.split("x")
  n = 1
  for d in dims:
    n *= int(d)
  return n * _BYTES.get(dtype, 4)


def allocations(text: str) -> list[str]:
  """The tensor types of a StableHLO text's AllocateBuffer custom calls."""
  return re.findall(r"custom_call @AllocateBuffer\(\).*?-> tensor<([^>]*)>", text)


def _config(size: str, batch: int, seq: int, accum: int, overrides=()):
  from benchmarks.common import set_overrides
  from configs import small
  cfg = small.get_config(size)
  set_overrides(cfg, overrides)
  cfg.data.seq_len, cfg.data.batch_size = seq, batch * accum
  cfg.train.grad_accum_steps = accum
  cfg.model.seq_len = seq
  cfg.model.vision = None
  cfg.optim.frozen, cfg.optim.unfreeze_at = (), "never"
  return cfg


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="s3")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--accum", type=int, default=8)
  ap.add_argument("--top", type=int, default=8)
  ap.add_argument("--set", nargs="*", default=(), metavar="KEY=VALUE",
                  help="config keys, e.g. model.cast_weights_once=false")
  args = ap.parse_args(argv)

  import jax
  import numpy as np
  from jax.extend import core as jcore
  from configs.common import MeshConfig
  from launch import aot, setup, unfilled_buffers

  cfg = _config(args.size, args.batch, args.seq, args.accum, tuple(args.set))
  mesh = setup.build_mesh(MeshConfig(data=1), jax.devices()[:1])
  low = aot.lower_args(cfg, mesh, args.batch * args.accum)

  def lowered_text() -> str:
    with jax.set_mesh(low.mesh):
      return jax.jit(low.step, donate_argnums=(0,), out_shardings=low.out_shardings).trace(
          *low.args).lower(lowering_platforms=("cuda",)).as_text()

  print(f"{args.size}, {args.accum} x ({args.batch} x {args.seq}) {' '.join(args.set)}, "
        "train step lowered for CUDA")
  for which, parts in (("stacks", dict(switch_slots=False)), ("switch slots", dict(stacks=False)),
                      ("both", {})):
    assert unfilled_buffers.install(**parts)
    shapes = allocations(lowered_text())
    unfilled_buffers.uninstall()
    total = sum(map(tensor_bytes, shapes))
    print(f"  {which}: {len(shapes)} AllocateBuffers, {total / 1e9:.3f} GB")
    if which == "both":
      for b, t in sorted(((tensor_bytes(t), t) for t in shapes), reverse=True)[:args.top]:
        print(f"    {b / 1e6:9.1f} MB  {t}")

  with jax.set_mesh(low.mesh):
    jaxpr = jax.make_jaxpr(low.step)(*low.args)

  def nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * aval.dtype.itemsize if hasattr(aval, "dtype") else 0

  print("switches (lax.cond with > 12 outputs): outputs, and per branch the outputs that are "
        "its inputs")

  def walk(j, path):
    for e in j.eqns:
      if e.primitive.name == "cond" and len(e.outvars) > 12:
        fwd = []
        for br in e.params["branches"]:
          ins = set(br.jaxpr.invars)
          fwd.append(sum(nbytes(v.aval) for v in br.jaxpr.outvars
                         if not isinstance(v, jcore.Literal) and v in ins))
        print(f"  {path}: {len(e.outvars)} outputs, {sum(nbytes(v.aval) for v in e.outvars) / 1e6:.0f}"
              f" MB; forwarded per branch {[round(f / 1e6) for f in fwd]} MB")
      for sub in jcore.jaxprs_in_params(e.params):
        walk(sub, f"{path}/{e.primitive.name}")

  walk(jaxpr.jaxpr, "step")
  return 0


if __name__ == "__main__":
  sys.exit(main())
