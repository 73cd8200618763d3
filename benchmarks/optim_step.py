"""Optimizer chain vs plain `optax.adamw` (docs/design.md §T2): step time and a small training run.

  python benchmarks/optim_step.py --part=step    # step time on a ~100M-parameter tree
  python benchmarks/optim_step.py --part=train   # byte-level LM on Python stdlib sources

`step`: a parameter tree shaped like a small MoE transformer with the model's own parameter paths
(so the project's table routes it), ~100M parameters; the jitted optimizer update (Muon with
Newton–Schulz on every matrix, Sinkhorn on embedding / head, AdamW on norms) against
`optax.adamw` on the same tree. `train`: a 2-layer byte-level transformer LM (written here, with
its own small table) trained for a fixed number of steps on the Python standard library's source
text, with the chain and with AdamW at the same schedule; held-out loss in bits per byte.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from optim import build_optimizer, learning_rate, table  # noqa: E402
from optim.config import OptimConfig  # noqa: E402
from optim.table import Row  # noqa: E402


# --- part 1: step time -------------------------------------------------------------------------

def moe_tree(vocab=32768, d=1024, layers=2, experts=8, mlp=512, heads=8, hd=128, q_lora=256,
             o_groups=4, o_lora=256):
  """~100M parameters with the model's paths; layers stacked on a leading axis (scan)."""
  f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  L = layers
  layer = {
      "attn_norm": {"scale": f(L, d)}, "ffn_norm": {"scale": f(L, d)},
      "attn": {"wq_a": f(L, d, q_lora), "q_norm": {"scale": f(L, q_lora)},
               "wq_b": f(L, q_lora, heads, hd), "wkv": f(L, d, hd), "kv_norm": {"scale": f(L, hd)},
               "attn_sink": f(L, heads), "wo_a": f(L, o_groups, heads // o_groups * hd, o_lora),
               "wo_b": f(L, o_groups * o_lora, d)},
      "moe": {"router": f(L, d, experts),
              "experts": {"w1": f(L, experts, d, mlp), "w3": f(L, experts, d, mlp),
                          "w2": f(L, experts, mlp, d)},
              "shared": {"w1": f(L, d, mlp), "w3": f(L, d, mlp), "w2": f(L, mlp, d)}},
  }
  return {"embed": f(vocab, d), "head": f(d, vocab), "final_norm": {"scale": f(d)},
          "runs": {"0": {"core": layer}}}


def _materialize(abstract, seed):
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [0.02 * jax.random.normal(k, x.shape, x.dtype)
                                      for k, x in zip(keys, leaves)])


def time_step(tx, params, grads, repeats):
  state = jax.jit(tx.init)(params)

  @jax.jit
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  t0 = time.perf_counter()
  jax.block_until_ready(step(grads, state, params))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(step(grads, state, params))
    times.append(time.perf_counter() - t0)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  return compile_s, float(np.median(times)), min(times), state_bytes


def part_step(repeats):
  abstract = moe_tree()
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  params, grads = _materialize(abstract, 0), _materialize(abstract, 1)
  cfg = OptimConfig(lr=1e-3, warmup_steps=10, decay_start=100, decay_end=200, schedule_unit="steps")
  rows = table.label_params(abstract)
  per_group = {g: sum(int(np.prod(x.shape)) for p, x in table.flatten_params(abstract)
                      if rows[p].group == g) for g in table.GROUPS}
  print(f"parameters: {n:,} ({', '.join(f'{g} {c:,}' for g, c in per_group.items())})")
  print(f"devices: {jax.devices()}")
  out = {}
  for name, tx in (("chain", build_optimizer(cfg, abstract)),
                   ("optax.adamw", optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-20,
                                               weight_decay=0.1))):
    c, med, best, sb = time_step(tx, params, grads, repeats)
    out[name] = med
    print(f"| {name} | {med * 1e3:,.1f} ms | {best * 1e3:,.1f} ms | {c:,.1f} s | {sb / 2**20:,.0f} MiB |")
  print(f"chain / adamw step time: {out['chain'] / out['optax.adamw']:.1f}x")


# --- part 2: a small LM on Python stdlib sources ----------------------------------------------

LM_TABLE = (
    Row("embed", "sinkhorn"), Row("head", "sinkhorn"),
    Row("layers/*/attn/{wq,wk,wv}", "muon", headwise=True),
    Row("layers/*/attn/wo", "muon"), Row("layers/*/mlp/{w1,w2}", "muon"),
    Row("**/scale", "adamw"),
)


def stdlib_bytes(limit: int) -> np.ndarray:
  root = sysconfig.get_paths()["stdlib"]
  chunks, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests",
                                                           "__pycache__", "idlelib"))
    for fn in sorted(filenames):
      if fn.endswith(".py"):
        with open(os.path.join(dirpath, fn), "rb") as fh:
          data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= limit:
          return np.frombuffer(b"".join(chunks)[:limit], np.uint8)
  return np.frombuffer(b"".join(chunks), np.uint8)


def init_lm(key, d=128, layers=2, heads=4, mlp=512, vocab=256):
  hd = d // heads
  ks = iter(jax.random.split(key, 8 * layers + 2))
  nrm = lambda shape, fan: jax.random.normal(next(ks), shape) / math.sqrt(fan)
  params = {"embed": jax.random.normal(next(ks), (vocab, d)),
            "head": nrm((d, vocab), d), "final_norm": {"scale": jnp.ones(d)}, "layers": {}}
  for j in range(layers):
    params["layers"][str(j)] = {
        "attn_norm": {"scale": jnp.ones(d)}, "mlp_norm": {"scale": jnp.ones(d)},
        "attn": {"wq": nrm((d, heads, hd), d), "wk": nrm((d, heads, hd), d),
                 "wv": nrm((d, heads, hd), d), "wo": nrm((d, d), d)},
        "mlp": {"w1": nrm((d, mlp), d), "w2": nrm((mlp, d), mlp)}}
  return params


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def lm_loss(params, tokens_BxT):
  x_BxTxD = params["embed"][tokens_BxT[:, :-1]]
  T = x_BxTxD.shape[1]
  mask_TxT = jnp.tril(jnp.ones((T, T), bool))
  for j in sorted(params["layers"], key=int):
    p = params["layers"][j]
    h = _rms_norm(x_BxTxD, p["attn_norm"]["scale"])
    q = jnp.einsum("btd,dhk->bhtk", h, p["attn"]["wq"])
    k = jnp.einsum("btd,dhk->bhtk", h, p["attn"]["wk"])
    v = jnp.einsum("btd,dhk->bhtk", h, p["attn"]["wv"])
    s = jnp.einsum("bhtk,bhsk->bhts", q, k) / math.sqrt(q.shape[-1])
    a = jax.nn.softmax(jnp.where(mask_TxT, s, -1e30), -1)
    o = jnp.einsum("bhts,bhsk->bthk", a, v).reshape(x_BxTxD.shape)
    x_BxTxD = x_BxTxD + o @ p["attn"]["wo"]
    h = _rms_norm(x_BxTxD, p["mlp_norm"]["scale"])
    x_BxTxD = x_BxTxD + jax.nn.gelu(h @ p["mlp"]["w1"]) @ p["mlp"]["w2"]
  logits = _rms_norm(x_BxTxD, params["final_norm"]["scale"]) @ params["head"]
  logp = jax.nn.log_softmax(logits, -1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens_BxT[:, 1:, None], -1))


def train(tx, data, steps, batch, seq, seed=0):
  params = init_lm(jax.random.key(seed))
  state = tx.init(params)

  @jax.jit
  def step(params, state, tokens):
    loss, grads = jax.value_and_grad(lm_loss)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  rng = np.random.default_rng(seed)
  train_data, eval_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
  t0 = time.perf_counter()
  for _ in range(steps):
    starts = rng.integers(0, len(train_data) - seq - 1, batch)
    tokens = np.stack([train_data[s:s + seq + 1] for s in starts]).astype(np.int32)
    params, state, loss = step(params, state, tokens)
  loss = float(loss)
  elapsed = time.perf_counter() - t0
  eval_rng = np.random.default_rng(1234)
  eval_fn = jax.jit(lm_loss)
  losses = []
  for _ in range(8):
    starts = eval_rng.integers(0, len(eval_data) - seq - 1, batch)
    losses.append(float(eval_fn(params, np.stack([eval_data[s:s + seq + 1] for s in starts])
                                .astype(np.int32))))
  return loss, float(np.mean(losses)) / math.log(2), elapsed


def part_train(steps, lrs, batch, seq):
  data = stdlib_bytes(4 << 20)
  print(f"data: {len(data):,} bytes of Python stdlib sources; {steps} steps of {batch}x{seq} bytes")
  warmup = steps // 10
  for lr in lrs:
    cfg = OptimConfig(lr=lr, warmup_steps=warmup, decay_start=steps // 2, decay_end=steps,
                      schedule_unit="steps", final_lr_fraction=0.1, clip_norm=1.0)
    example = init_lm(jax.random.key(0))
    chain = build_optimizer(cfg, example, LM_TABLE)
    sched = lambda s, cfg=cfg: learning_rate(cfg, s)
    adamw = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-20, weight_decay=0.1))
    for name, tx in (("chain", chain), ("optax.adamw", adamw)):
      last, eval_bpb, secs = train(tx, data, steps, batch, seq)
      print(f"| {name} | {lr:g} | {last:.3f} | {eval_bpb:.3f} | {secs:.0f} s |", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--part", choices=("step", "train", "all"), default="all")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--lrs", default="1e-3,3e-3")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=128)
  args = ap.parse_args()
  if args.part in ("step", "all"):
    print("| optimizer | median step | best step | compile | state |")
    part_step(args.repeats)
  if args.part in ("train", "all"):
    print("| optimizer | peak lr | last train loss (nats) | held-out bits/byte | wall |")
    part_train(args.steps, [float(x) for x in args.lrs.split(",")], args.batch, args.seq)


if __name__ == "__main__":
  main()
