"""Inference: CED prefill vs full-depth prefill (FLOPs and time), decode tokens/s, cache bytes.

  python benchmarks/inference.py                                  # tiny model, random weights
  python benchmarks/inference.py --workdir=/tmp/dsv41_tiny        # the tiny main job's checkpoint

Model: `configs/tiny.py` text only (or the checkpoint's), caches in their stored formats
(`dsv41_jax.inference`). For each prompt length N:

* prefill FLOPs: XLA's `cost_analysis()["flops"]` of the compiled programs: "full" = every layer
  over the N tokens; "ced" = the encoder over N tokens, the decoder's KV projection and the
  decoder over the last min(N, W) tokens (bounded replay). The indexer runs unchunked
  (`index_query_chunk=0`, same results) so that no loop hides work from the count (the only loop
  left is the elementwise Sinkhorn). The ratio ced / full is the figure the report puts at ≈ 0.5
  (docs/design.md §6); the ledger's activated-parameter ratio (prefill / decode) is printed beside it.
* prefill time: median of 3 runs after compilation (one program each).
* decode: tokens/s of one-token steps at batch 1 and 8 (N-token prompt, 32 steps).
* cache: global bytes per token from the arrays vs the ledger (tiny and Flash configs).

With --workdir, also the exactness figures on the trained weights: max |Δlogit| between decode and
the forward pass with the cache formats' fake quantizers on (exact path), the bounded-replay
divergence, and the quantized caches vs the trained (quantizers off) forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import command, machine, median_seconds
from configs.common import model_config
from dsv41_jax import cache_layout, ledger, model as M
from dsv41_jax.config import ModelConfig
from dsv41_jax.inference import Decoder, cache as C, decode
from launch.aot import xla_flops

QAT = dict(fp4_main_kv=True, fp4_indexer=True, fp8_swa_kv=True)
UNCHUNKED = dict(index_query_chunk=0, attn_query_chunk=0)


def prefill_figures(dec: Decoder, N: int, reps: int = 3) -> dict:
  cfg = dec.cfg
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, N)).astype(np.int32)
  ids = dec.engram_ids(tokens)
  cache = C.init_cache(cfg, 1, N + 1)
  args = (dec.params, cache, jnp.asarray(tokens), ids, dec.moe_bias)
  out = {"N": N}
  for depth in ("full", "ced"):
    flops = xla_flops(dec._prefill.lower(*args, depth).compile())
    seconds = median_seconds(lambda: dec.prefill(tokens, N + 1, depth)[0], reps=reps)
    out[depth] = {"flops": flops, "seconds": seconds}
  out["flops_ratio"] = out["ced"]["flops"] / out["full"]["flops"]
  out["time_ratio"] = out["ced"]["seconds"] / out["full"]["seconds"]
  return out


def decode_figures(dec: Decoder, N: int, batch: int, steps: int = 32) -> dict:
  cfg = dec.cfg
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, N + steps)).astype(np.int32)
  _, cache = dec.prefill(tokens[:, :N], N + steps, "ced")
  logits, cache = dec.step(cache, tokens, N)     # compile
  jax.block_until_ready(logits)
  t0 = time.perf_counter()
  for t in range(N + 1, N + steps):
    logits, cache = dec.step(cache, tokens, t)
  jax.block_until_ready(logits)
  dt = time.perf_counter() - t0
  return {"batch": batch, "tokens_per_s": batch * (steps - 1) / dt, "ms_per_step": 1e3 * dt / (steps - 1)}


def exactness(model, bias, cmap, T: int) -> dict:
  """Max |Δlogit| over the positions of a T-token sequence (prefill of 1 token, then decode):
  the exact path (caches holding the forward pass's values) vs the trained forward pass; the CED
  bounded replay (prompt of 3W) by position; the stored formats vs the forward pass with the QAT
  quantizers on (code flips only) and vs the trained forward pass (the formats' approximation)."""
  cfg = model.cfg
  params = nnx.split(model)[1]
  qat_model = nnx.merge(nnx.split(M.abstract_model(cfg.replace(**QAT)))[0], params)
  tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
  plain = Decoder(model, bias, cmap, stored_formats=False)
  stored = Decoder(qat_model, bias, cmap)
  batch = dict(tokens=jnp.asarray(tokens), positions=jnp.arange(T)[None],
               segment_ids=jnp.ones((1, T), jnp.int32),
               engram_ids={k: jnp.asarray(v) for k, v in plain.engram_ids(tokens).items()})
  ref = np.asarray(jax.jit(lambda b: model(b, bias)[0])(batch))[0]
  ref_qat = np.asarray(jax.jit(lambda b: qat_model(b, bias)[0])(batch))[0]

  def run(dec, depth, N):
    logits, cache = dec.prefill(tokens[:, :N], T, depth)
    out = [np.asarray(logits)[0]]
    for t in range(N, T):
      logits, cache = dec.step(cache, tokens, t)
      out.append(np.asarray(logits)[0])
    return np.stack(out)

  exact = run(plain, "full", 1)
  n = 3 * cfg.sliding_window
  by_pos = np.abs(run(plain, "ced", n) - ref[n - 1:]).max(-1)
  q = run(stored, "full", 1)
  return {"T": T, "logit_scale": float(np.abs(ref).max()),
          "exact_path_max_abs": float(np.abs(exact - ref).max()),
          "ced_prompt": n, "ced_max_abs_by_position": [float(f"{v:.3g}") for v in by_pos],
          "stored_vs_qat_forward_max_abs": float(np.abs(q - ref_qat).max()),
          "stored_vs_qat_forward_median_abs": float(np.median(np.abs(q - ref_qat).max(-1))),
          "stored_vs_trained_forward_max_abs": float(np.abs(q - ref).max()),
          "stored_vs_trained_argmax_agreement": float((q.argmax(-1) == ref.argmax(-1)).mean())}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default=None)
  ap.add_argument("--lengths", default="256,1024")
  ap.add_argument("--out", default=None)
  a = ap.parse_args()
  if a.workdir:
    from launch.generate import load_model
    loaded = load_model(a.workdir)
    model, bias, cmap = loaded.model, loaded.moe_bias, loaded.compression_map
    cfg = model.cfg
  else:
    from configs.tiny import get_config
    cfg = model_config(get_config()).replace(vision=None, **QAT, **UNCHUNKED)
    model, bias, cmap = M.init_model(cfg, 0), M.zero_moe_bias(cfg), None
  results: dict = {"command": command(), "machine": machine()}
  cfg_q = cfg.replace(**QAT, **UNCHUNKED)
  lg = ledger.ledger(cfg_q)
  results["ledger_active_prefill_over_decode"] = lg["active_params_prefill"] / lg["active_params_decode"]
  for c, name in ((cfg_q, "model"), (ModelConfig(), "flash")):
    cache = C.init_cache(c, 1, 64)
    results[f"cache_{name}"] = {"measured_bytes_per_token": C.global_bytes_per_token(cache, 64),
                                "ledger_bytes_per_token": cache_layout.global_kv_layout(c).bytes_per_token,
                                "swa_bytes_per_sequence": C.swa_bytes_per_sequence(cache)}
  dec = Decoder(nnx.merge(nnx.split(M.abstract_model(cfg_q))[0], nnx.split(model)[1]), bias, cmap)
  lengths = [int(x) for x in a.lengths.split(",") if x]       # --lengths= skips the timings
  results["prefill"] = []
  for N in lengths:
    r = prefill_figures(dec, N)
    print(json.dumps(r), flush=True)
    results["prefill"].append(r)
  if lengths:
    results["decode"] = [decode_figures(dec, lengths[0], b) for b in (1, 8)]
    print(json.dumps(results["decode"]), flush=True)
  if a.workdir:
    results["exactness"] = exactness(model, bias, cmap, int(cfg.seq_len))
    print(json.dumps(results["exactness"]), flush=True)
  text = json.dumps(results, indent=1)
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
