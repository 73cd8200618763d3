"""Compile time of a training forward+backward vs depth, with and without the layer scan.

  python benchmarks/compile_scaling.py [--repeats 1 4]

`tiny` is configs/tiny.py (12 layers). Deeper variants keep its structure and add repeated units:
each encoder unit is (Full, Reuse) at m = 2 and each decoder unit (Reindex, Reuse) at m = 1, so the
layer plan has the same segments with larger `repeats`. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np
from flax import nnx

from configs import common, tiny
from dsv41_jax import inputs, model as M
from dsv41_jax.loss import objective


def deepen(cfg, extra_units: int):
  """tiny with `extra_units` more (Full, Reuse) encoder units and (Reindex, Reuse) decoder units."""
  n_enc = 6 + 2 * extra_units
  ratios = (0, 0) + (2,) * (n_enc - 2) + (1,) * n_enc
  enc_full = tuple(range(2, n_enc, 2))
  dec_idx = tuple(range(n_enc, 2 * n_enc, 2))
  return cfg.replace(num_hidden_layers=2 * n_enc, compress_ratios=ratios,
                     kv_source_layer_ids=enc_full + (n_enc,),
                     index_source_layer_ids=enc_full + dec_idx,
                     engram_layer_ids=(1, n_enc - 2))


def compile_seconds(cfg, batch_size=2):
  graphdef, state = nnx.split(nnx.eval_shape(lambda: M.Transformer(cfg, nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  T = cfg.seq_len
  tokens = rng.integers(0, cfg.vocab_size, (batch_size, T))
  seg = np.ones((batch_size, T), np.int32)
  pos = np.tile(np.arange(T, dtype=np.int32), (batch_size, 1))
  batch = dict(tokens=tokens, positions=pos, segment_ids=seg, targets=tokens,
               loss_mask=np.ones((batch_size, T), bool),
               engram_ids=inputs.engram_ids(cfg, tokens, seg))
  bias = M.zero_moe_bias(cfg)

  def loss_fn(params):
    logits, aux = nnx.merge(graphdef, params)(batch, bias)
    return objective(cfg, logits, aux, batch)[0]

  t0 = time.perf_counter()
  lowered = jax.jit(jax.value_and_grad(loss_fn)).lower(state)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  hlo_bytes = len(compiled.as_text())
  return t1 - t0, t2 - t1, hlo_bytes


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--extra", type=int, nargs="*", default=[0, 4])
  args = ap.parse_args()
  base = common.model_config(tiny.get_config())
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}")
  print("| layers | scan | trace+lower s | compile s | compiled HLO text bytes |")
  print("|---|---|---|---|---|")
  for extra in args.extra:
    for scan in (True, False):
      cfg = deepen(base, extra).replace(scan_layers=scan)
      lower_s, compile_s, size = compile_seconds(cfg)
      print(f"| {cfg.num_hidden_layers} | {scan} | {lower_s:.1f} | {compile_s:.1f} | {size:,} |",
            flush=True)


if __name__ == "__main__":
  main()
