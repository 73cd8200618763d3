"""Size and compile time of the whole train step vs depth (issue 10: program size independent of depth).

  python benchmarks/compile_scaling.py                    # tiny widths, layouts of 12 and 24 layers
  python benchmarks/compile_scaling.py --layers 12 --tiny  # configs/tiny.py itself

The step is `launch.step.make_train_step` (model forward + backward, the optimizer chain, finite check, MoE bias update)
on text rows of batch 8 × 128, lowered with abstract inputs and compiled (never run). Depth variants keep the
small configs' Flash layout (`configs/small.layout(L)`) at configs/tiny.py's widths. Reported: lowered StableHLO bytes,
`dot_general` count, trace + lower seconds, XLA compile seconds, and the number of fusions in the compiled HLO (a proxy
for the kernels a GPU backend generates). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import header, md_header  # noqa: E402
from configs import common, small, tiny  # noqa: E402
from dsv41_jax import model as M  # noqa: E402
from dsv41_jax.layer_plan import build_layer_plan  # noqa: E402
from launch.step import TrainState, engram_sub_tables, make_train_step  # noqa: E402
from optim.chain import build_optimizer  # noqa: E402
from optim.config import optim_config  # noqa: E402


def step_program(cfg, B: int = 8):
  """(jitted step, abstract args) of the train step for model config `cfg`."""
  model = M.abstract_model(cfg)
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)
  ocfg = optim_config(dict(tiny.get_config().optim, frozen=(), unfreeze_at="never"))
  tx = build_optimizer(ocfg, params, sub_tables=engram_sub_tables(model))
  opt_state = jax.eval_shape(tx.init, params)
  T = cfg.seq_len
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  n_ids = len(cfg.engram_orders) * cfg.engram_n_heads
  batch = dict(tokens=i32(B, T), positions=i32(B, T), segment_ids=i32(B, T), targets=i32(B, T),
               loss_mask=jax.ShapeDtypeStruct((B, T), jnp.bool_),
               engram_ids={l.index: i32(B, T, n_ids) for l in build_layer_plan(cfg) if l.engram})
  bias = jax.ShapeDtypeStruct((cfg.num_hidden_layers, 2, cfg.n_routed_experts), jnp.float32)
  step = jax.jit(make_train_step(cfg, graphdef, tx, ocfg.moe_bias_gamma), static_argnums=(2,))
  return step, (TrainState(params, opt_state, bias), batch, False)


def measure(cfg) -> dict:
  step, args = step_program(cfg)
  t0 = time.perf_counter()
  lowered = step.lower(*args)
  t1 = time.perf_counter()
  text = lowered.as_text()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  fusions = sum(" fusion(" in line for line in compiled.as_text().splitlines())
  return dict(stablehlo_bytes=len(text), dots=text.count("dot_general"), lower_s=t1 - t0,
              compile_s=t2 - t1, fusions=fusions)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, nargs="*", default=[12, 24])
  ap.add_argument("--tiny", action="store_true", help="configs/tiny.py's own plan (12 layers)")
  args = ap.parse_args()
  base = common.model_config(tiny.get_config()).replace(vision=None)
  print(header())
  print(md_header("layers", "StableHLO bytes", "dot_general", "trace+lower s", "compile s",
                  "fusions"))
  cfgs = [("tiny", base)] if args.tiny else [(str(L), base.replace(**small.layout(L)))
                                              for L in args.layers]
  for name, cfg in cfgs:
    r = measure(cfg)
    print(f"| {name} | {r['stablehlo_bytes']:,} | {r['dots']} | {r['lower_s']:.1f} | "
          f"{r['compile_s']:.1f} | {r['fusions']:,} |", flush=True)


if __name__ == "__main__":
  main()
