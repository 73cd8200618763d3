"""The tiny config's loss and gradient in two trees of the model, compared layer by layer (session 52:
the Engram injection under `lax.cond` against the split scans of `calls/s52_engram_split.patch`).

  cd TREE_A && PYTHONPATH=$PWD python benchmarks/model_tree_compare.py dump /tmp/cmp
  cd TREE_B && PYTHONPATH=$PWD python benchmarks/model_tree_compare.py check /tmp/cmp

`dump` initialises the model (seed 0) and writes its parameters and its gradient per layer (a run's
stacks cut into layers by the plan, so trees whose runs differ compare too) with the loss; `check`
rebuilds the parameters from that dump in its own tree's layout, computes the same loss and
gradient, and prints whether they are equal bit for bit and the largest difference relative to
each leaf's largest entry. CPU, a few seconds.
"""
import sys, re, numpy as np, jax, jax.numpy as jnp
from flax import nnx
from dsv41_jax import model as M, testing
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.loss import objective
from pallas_kernels.ops.paths import path_str
from configs import tiny
from launch.setup import run_config
mode, fname = sys.argv[1:]
cfg = run_config(tiny.get_config(), process_count=1).model
plan = build_layer_plan(cfg)
print("engram", cfg.engram_layer_ids, "runs", [(r.first_layer, r.n_layers) for r in plan.runs])
RX = re.compile(r"^runs/(\d+)/([^/]+)/(.*)$")

def per_layer(state):
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    p = path_str(path); a = np.asarray(leaf); m = RX.match(p)
    if not m: out[f"G|{p}"] = a; continue
    run = plan.runs[int(m.group(1))]; g, rest = m.group(2), m.group(3)
    if g == "engram": out[f"{run.engram_layer}|engram|{rest}"] = a; continue
    for i, l in enumerate(run.layers):
      if g == "core": out[f"{l.index}|core|{rest}"] = a[i]
      elif run.kinds[run.kind_of[i]].kind_name == g: out[f"{l.index}|{g}|{rest}"] = a[run.slot_of[i]]
  return out

def assemble(state, d):
  leaves, tdef = jax.tree_util.tree_flatten_with_path(state)
  new = []
  for path, leaf in leaves:
    p = path_str(path); m = RX.match(p)
    if not m: new.append(jnp.asarray(d[f"G|{p}"])); continue
    run = plan.runs[int(m.group(1))]; g, rest = m.group(2), m.group(3)
    if g == "engram": new.append(jnp.asarray(d[f"{run.engram_layer}|engram|{rest}"])); continue
    rows = [l.index for i, l in enumerate(run.layers)
            if g == "core" or run.kinds[run.kind_of[i]].kind_name == g]
    key = "core" if g == "core" else g
    new.append(jnp.asarray(np.stack([d[f"{l}|{key}|{rest}"] for l in rows])).astype(leaf.dtype))
  return jax.tree_util.tree_unflatten(tdef, new)

m = M.Transformer(cfg, rngs=nnx.Rngs(0))
graphdef, state = nnx.split(m)
if mode == "check":
  state = assemble(state, dict(np.load(fname + ".params.npz")))
batch = jax.tree.map(jnp.asarray, testing.packed_batch(cfg, 0))
def loss(p):
  out, aux = nnx.merge(graphdef, p)(batch, M.zero_moe_bias(cfg))
  return objective(cfg, out, aux, batch)[0]
l, g = jax.jit(jax.value_and_grad(loss))(state)
gl = per_layer(g)
if mode == "dump":
  np.savez(fname + ".params.npz", **per_layer(state))
  np.savez(fname + ".grads.npz", loss=np.asarray(l), **gl)
  print("loss", float(l))
else:
  ref = dict(np.load(fname + ".grads.npz"))
  print("loss", float(l), "old", float(ref["loss"]), "equal", float(l) == float(ref["loss"]))
  assert set(ref) - {"loss"} == set(gl), (set(ref) ^ set(gl))
  worst = max((float(np.max(np.abs(gl[k].astype(np.float64) - ref[k]))) / (float(np.max(np.abs(ref[k]))) + 1e-30), k) for k in gl)
  same = sum(np.array_equal(gl[k], ref[k]) for k in gl)
  print(f"bitwise equal leaves {same}/{len(gl)}; worst relative {worst}")
