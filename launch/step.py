"""The pure, jitted training and evaluation steps (docs/design.md §T2, §T6).

    train_step(state, batch, train_vit, schedule) -> (state, metrics)   # state: a `TrainState`

`TrainState` is the whole train state as one pytree: parameters, optimizer state and MoE routing
biases; its shardings are a `TrainState` of `NamedSharding`s, so every part is reached by name.
A step whose loss, gradient norm or update norm is not finite applies nothing: the state comes
back unchanged and `metrics["finite"]` is false (the loop counts such steps).

The MoE routing bias is updated outside the optimizer from the step's per-modality expert loads.
`engram_sub_tables(model)` is the Engram table layout the optimizer needs (`build_optimizer`'s
`sub_tables`: one Sinkhorn balancing per head table, docs/design.md §T2).

Passes over the parameters (issue 28 item 3; figures of the H200 s3 profile, 2.14 B float32
parameters, 8.6 GB a tree). The gradient is summed once for its norm: `leaf_sq_sums` gives each
leaf's Σg², added up for the `grad_norm` metric and handed to the optimizer's clip, which then sums
only the frozen leaves again (`optim.chain._clip_by_global_norm`). The guard is a `jnp.where` per
leaf, and it is not a pass of its own: XLA fuses `apply_updates` and the optimizer state's
elementwise update (momentum βm + g, Adam's moments) into it, so its fusions read p, the update's
inputs, m and g and write p' and m', the one write of the new state. The 12.75 ms the profile
charges to that line is 51.5 GB at 4.0 TB/s, the bytes of exactly those reads and writes; no fusion
writes a new momentum before it (none at the momentum's line; `_normalized`, 3.05 ms, is one read
of the Muon group's m and g). What the guard costs is order, as nothing may be written before the
update norm is known: the update norm is a pass over the update's inputs of its own (4.35 ms, which
without the guard could ride on the pass that writes p'), and the state's update reads m and g a
second time in that final pass rather than being written by the pass that reads them for the
direction (17 GB, ~4 ms). Neither goes while the state is donated and a rejected step must leave it
bit for bit: that would take the old state kept in buffers of its own. Tried on the CPU (the micro
model's compiled program; bytes in reads or writes of the whole parameter tree): `lax.cond(finite,
new, old)` over the optimizer state copies every state leaf into the conditional's result (a
conditional's result never takes its operand's buffer): 1.0 fewer, the select's reads traded for
2.0 of copies, with a second state alive beside the first; the state recomputed inside the true
branch (its Newton–Schulz dead code there) has no copies and 1.4 fewer, because the CPU's XLA
writes the new momentum before the select, which the GPU's, by the profile, does not; and it moves
the Muon direction's fusions, which changes the CPU's float32 rounding (≤ 1 ulp in 4-6 % of the
entries of 18 Muon parameters after one step). Neither is taken.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.engram import Engram
from dsv41_jax.layers.moe_dispatch import gate_and_up, gate_up_pair
from dsv41_jax.loss import batch_counts, cross_entropy, objective
from dsv41_jax.param_paths import path_str
from optim.chain import global_norm, leaf_sq_sums
from optim.moe_bias import update_moe_bias

MODEL_KEYS = ("tokens", "positions", "segment_ids", "image_mask", "engram_ids", "images",
              "image_count", "image_cells", "image_starts")


class TrainState(NamedTuple):
  """The train state as one pytree (arrays, ShapeDtypeStructs, or their NamedShardings)."""

  params: Any      # the model's parameters (nnx.as_pure of its nnx.State)
  opt_state: Any   # the optimizer chain's state (optim/chain.py)
  moe_bias: Any    # MoE routing biases [L, 2, E], updated outside the optimizer (§T2)


def engram_sub_tables(model: nnx.Module) -> dict[str, tuple[tuple[int, int], ...]]:
  """Parameter path of each Engram table → ((offset, rows), ...) of its (order, head) sub-tables
  (docs/design.md §7.2); the padding rows after the last one belong to none."""
  return {path_str(path) + "/table": tuple(zip(m.sub_table_offsets, m.sub_table_sizes))
          for path, m in nnx.iter_modules(model) if isinstance(m, Engram)}


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
  return {k: batch[k] for k in MODEL_KEYS if k in batch}


def micro_batches(batch: dict[str, Any], k: int) -> dict[str, Any]:
  """Every leaf [B, ...] as [k, B/k, ...]: micro-batch m holds rows m, m + k, m + 2k, … so that,
  with the rows split over devices in contiguous blocks, each micro-batch splits over the same
  devices (B a multiple of k × the batch's device ways, `launch.setup.global_batch`)."""
  return jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0),
                      batch)


# The parameters the model reads only as `ModelConfig.dtype`, each use a `w.astype(dtype)` of the
# whole weight feeding a product (attention and indexer projections, experts, Engram's key/value
# projection). `ModelConfig.cast_weights_once` casts them once per step: every micro-batch's forward
# and remat forward then read the cast copy, and the gradient of that copy (the product's cotangent
# in `dtype`, which autodiff of the per-use cast would convert to float32 unchanged) is converted
# here. Not listed: weights also read in float32 (the compressor's, the router, mHC, norms, the
# head under the chunked loss, the embedding's gather, Engram's tables and gates). A weight listed
# here that some path reads in float32 changes the loss; `test_step` guards that on a model with
# every kind of layer.
CAST_ONCE = re.compile(r"^runs/\d+/[^/]+/(attn/(wq_a|wq_b|wkv|wo_a|wo_b)|indexer/(wk|wq_b|weights_proj)"
                       r"|moe/(experts|shared)/(w1|w2|w3))$|^runs/\d+/engram/w_ekv$")


# The routed experts' gate and up weights, which `cast_once` hands over as one pair.
_GATE_UP = re.compile(r"^(runs/\d+/[^/]+/moe/experts)/w([13])$")


def _gate_up_leaves(tree) -> dict[str, tuple[int, int]]:
  """{experts prefix: (index of w1, index of w3)} among `tree`'s flattened leaves."""
  pairs: dict[str, dict[str, int]] = {}
  for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
    if m := _GATE_UP.match(path_str(path)):
      pairs.setdefault(m.group(1), {})[m.group(2)] = i
  return {k: (v["1"], v["3"]) for k, v in pairs.items() if len(v) == 2}


def cast_once(params, dtype):
  """The parameter tree with the `CAST_ONCE` leaves in `dtype`, and each routed-experts layer's
  w1 and w3 as one pair (`moe_dispatch.gate_up_pair`: the gate/up product reads
  [w1 | w3] without a concatenation in every layer's forward and remat pass)."""
  def cast(path, leaf):
    return leaf.astype(dtype) if CAST_ONCE.match(path_str(path)) else leaf
  read = jax.tree_util.tree_map_with_path(cast, params)
  leaves, treedef = jax.tree.flatten(read)
  for i1, i3 in _gate_up_leaves(read).values():
    leaves[i1], leaves[i3] = gate_up_pair(leaves[i1], leaves[i3])
  return jax.tree.unflatten(treedef, leaves)


def uncast(grads, params):
  """The gradient of `cast_once`'s tree as the gradient of `params` (each leaf to its dtype; a
  gate/up pair's gradient split back into w1's and w3's)."""
  leaves, treedef = jax.tree.flatten(grads)
  for i1, i3 in _gate_up_leaves(grads).values():
    leaves[i1], leaves[i3] = gate_and_up(leaves[i1], leaves[i3])
  return jax.tree.map(lambda g, p: g.astype(p.dtype), jax.tree.unflatten(treedef, leaves), params)


# The model's per-layer means (aux) and the `batch_counts` unit each one averages over.
_AUX_MEANS = {"dropped_fraction": "moe", "engram_gate_N": "engram",
              "engram_rows_touched": "engram_rows"}


def make_train_step(cfg: ModelConfig, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    bias_gamma: float, grad_accum_steps: int = 1) -> Callable:
  """The train step; with `grad_accum_steps` = k > 1 the batch is k micro-batches (`micro_batches`)
  whose gradients, losses and aux are summed in a `lax.scan`, each weighted by its share of the
  whole batch's units (`dsv41_jax.loss.batch_counts`), before one optimizer update: the same
  update, MoE bias step and metrics as one step over the whole batch, with one micro-batch's
  activations live at a time. `tx.update` is given the extra arguments `grad_sq_sums` (the
  gradient's `leaf_sq_sums`, which `build_optimizer`'s clip reads) and `schedule` (when the step
  is): any `optax.chain` takes them."""
  # With `lm_loss_chunk` the model hands the head's input and weight to the loss, which never
  # makes the whole batch's float32 logits (`loss.head_cross_entropy`).
  head = dict(return_hidden=True) if cfg.lm_loss_chunk else {}

  def loss_fn(params, moe_bias, batch, train_vit, share=None):
    out, aux = nnx.merge(graphdef, params)(model_inputs(batch), moe_bias, train_vit=train_vit,
                                           **head)
    total, parts = objective(cfg, out, aux, batch, share)
    return total, (parts, aux)

  value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

  def grad_fn(read, params, *args):
    """`value_and_grad` of `loss_fn` at `read` (`params`, or `cast_once`'s tree of it), the
    gradient in the dtypes of `params`."""
    out, grads = value_and_grad(read, *args)
    return out, uncast(grads, params)

  def accumulated(read, params, moe_bias, batch, train_vit):
    """(loss, parts, aux, grads) of the whole batch, summed over its micro-batches."""
    micro = micro_batches(batch, grad_accum_steps)
    counts = jax.lax.map(lambda mb: batch_counts(cfg, mb), micro)           # leaves [k, ...]
    shares = jax.tree.map(lambda c: c / jnp.maximum(c.sum(0), 1.0), counts)

    def one(mb, share):
      (loss, (parts, aux)), grads = grad_fn(read, params, moe_bias, mb, train_vit, share)
      aux = dict(load_2xE=aux["load_2xE"], **{n: aux[n] * share[u] for n, u in _AUX_MEANS.items()})
      return loss, parts, aux, grads

    def body(acc, xs):
      return jax.tree.map(jnp.add, acc, one(*xs)), None

    first = jax.tree.map(lambda x: x[0], (micro, shares))
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(one, *first))
    acc, _ = jax.lax.scan(body, zeros, (micro, shares))
    return acc

  def train_step(state: TrainState, batch, train_vit: bool = True, schedule=None):
    """`train_vit` (static) is False while the ViT is frozen: no gradient is computed for it.
    `schedule` (an `optim.schedule.Schedule`, an input of the program) sets the learning rate;
    None uses the optimizer config's schedule as constants."""
    params, opt_state, moe_bias = state
    read = cast_once(params, cfg.dtype) if cfg.cast_weights_once else params
    if grad_accum_steps == 1:
      (loss, (parts, aux)), grads = grad_fn(read, params, moe_bias, batch, train_vit)
    else:
      loss, parts, aux, grads = accumulated(read, params, moe_bias, batch, train_vit)
    sq_sums = leaf_sq_sums(grads)        # one read of every gradient: the metric and the clip
    grad_norm = global_norm(sq_sums)
    extra = dict(grad_sq_sums=sq_sums, **({} if schedule is None else {"schedule": schedule}))
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra)
    update_norm = optax.tree.norm(updates)
    # A finite gradient can still give a non-finite update (optimizer state gone bad): not applied.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    # optax.apply_updates' p + u with the finite select in the same expression: one pass over the
    # parameters (read p and u, write p') instead of a second that reads p' and p again (s3: 8.6 GB
    # of float32 parameters). The same values as keep(apply_updates(params, updates), params).
    new_params = jax.tree.map(
        lambda p, u: jnp.where(finite, jnp.asarray(p + u).astype(jnp.asarray(p).dtype), p),
        params, updates)
    new_bias = update_moe_bias(moe_bias, aux["load_2xE"], bias_gamma)
    load = aux["load_2xE"].sum(axis=1)                       # [L, E] over both modalities
    metrics = dict(parts, loss=loss, grad_norm=grad_norm, finite=finite,
                   update_norm=update_norm,
                   expert_load_max_over_mean=load.max(-1) / jnp.maximum(load.mean(-1), 1e-9),
                   moe_bias_range=moe_bias.max(-1) - moe_bias.min(-1),
                   dropped_fraction=aux["dropped_fraction"],
                   engram_gate=aux["engram_gate_N"], engram_rows_touched=aux["engram_rows_touched"])
    return TrainState(new_params, keep(new_opt_state, opt_state), keep(new_bias, moe_bias)), metrics

  return train_step


def make_eval_step(cfg: ModelConfig, graphdef: nnx.GraphDef) -> Callable:
  """Summed held-out cross-entropy (nats) and its token count, for loss and bits per byte."""

  def eval_step(params, moe_bias, batch, token_bytes_V):
    logits, _ = nnx.merge(graphdef, params)(model_inputs(batch), moe_bias)
    mean, n = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    n_bytes = jnp.sum(jnp.where(batch["loss_mask"], token_bytes_V[batch["targets"]], 0))
    return mean * n, n, n_bytes

  return eval_step
