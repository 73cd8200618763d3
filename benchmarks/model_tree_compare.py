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

from __future__ import annotations

import argparse
import os
import sys

# Appended, not prepended: a PYTHONPATH naming another tree of the model wins.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layer_rows(plan, path: str) -> list[tuple[str, int | None]]:
  """(per-layer key, row of the stacked leaf or None for the whole leaf) of a parameter path:
  a run's `core` stacks hold a row per layer, a kind's stacks a row per layer of that kind, the
  run's `engram` belongs to its Engram layer (`dsv41_jax.param_paths.per_layer_params`'s rules)."""
  from dsv41_jax.param_paths import _LAYER_PATH
  m = _LAYER_PATH.match(path)
  if not m:
    return [(f"global|{path}", None)]
  run = plan.runs[int(m.group(1))]
  group, rest = m.group(2), m.group(3)
  if group == "engram":
    return [(f"{run.engram_layer}|engram|{rest}", None)]
  rows = []
  for i, spec in enumerate(run.layers):
    if group == "core":
      rows.append((f"{spec.index}|core|{rest}", i))
    elif run.kinds[run.kind_of[i]].kind_name == group:
      rows.append((f"{spec.index}|{group}|{rest}", run.slot_of[i]))
  return rows


def per_layer(plan, tree) -> dict:
  """The leaves of a parameter-shaped tree cut into per-layer arrays (`layer_rows`)."""
  import jax
  import numpy as np
  from pallas_kernels.ops.paths import path_str
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(leaf)
    for key, row in layer_rows(plan, path_str(path)):
      out[key] = a if row is None else a[row]
  return out


def assemble(plan, like, arrays: dict):
  """A tree shaped as `like` built from `per_layer`'s arrays (each stack in `like`'s row order)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.ops.paths import path_str
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  new = []
  for path, leaf in leaves:
    rows = layer_rows(plan, path_str(path))
    if rows[0][1] is None:
      value = arrays[rows[0][0]]
    else:   # rows come in layer order; a kind's stack in slot order, which is the same order
      value = np.stack([arrays[key] for key, _ in sorted(rows, key=lambda r: r[1])])
    new.append(jnp.asarray(value).astype(leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, new)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("mode", choices=("dump", "check"))
  ap.add_argument("prefix", help="files PREFIX.params.npz and PREFIX.grads.npz")
  args = ap.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from configs import tiny
  from dsv41_jax import model as M, testing
  from dsv41_jax.layer_plan import build_layer_plan
  from dsv41_jax.loss import objective
  from launch.setup import run_config

  cfg = run_config(tiny.get_config(), process_count=1).model
  plan = build_layer_plan(cfg)
  print("runs (first layer, layers):", [(r.first_layer, r.n_layers) for r in plan.runs])
  graphdef, params = nnx.split(M.Transformer(cfg, rngs=nnx.Rngs(0)))
  if args.mode == "check":
    params = assemble(plan, params, dict(np.load(args.prefix + ".params.npz")))
  batch = jax.tree.map(jnp.asarray, testing.packed_batch(cfg, 0))

  def loss(p):
    out, aux = nnx.merge(graphdef, p)(batch, M.zero_moe_bias(cfg))
    return objective(cfg, out, aux, batch)[0]

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  grads = per_layer(plan, grads)
  if args.mode == "dump":
    np.savez(args.prefix + ".params.npz", **per_layer(plan, params))
    np.savez(args.prefix + ".grads.npz", loss=np.asarray(value), **grads)
    print(f"loss {float(value)!r}")
    return 0
  ref = dict(np.load(args.prefix + ".grads.npz"))
  ref_loss = float(ref.pop("loss"))
  if set(ref) != set(grads):
    print(f"error: the two trees' layers differ: {sorted(set(ref) ^ set(grads))[:5]}")
    return 2
  rel = {k: float(np.max(np.abs(grads[k].astype(np.float64) - ref[k]))
                  / max(float(np.max(np.abs(ref[k]))), 1e-30)) for k in grads}
  worst = max(rel, key=rel.get)
  same = sum(np.array_equal(grads[k], ref[k]) for k in grads)
  print(f"loss {float(value)!r} against {ref_loss!r} (equal: {float(value) == ref_loss})")
  print(f"gradient: {same} of {len(grads)} leaves bit for bit; largest difference "
        f"{rel[worst]:.2e} of the leaf's largest entry ({worst})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
