"""The whole DeepSeek-V4.1-Flash backbone: embedding, the plan-driven layer stack, head (docs/design.md).

The layer plan groups layers into runs (`layer_plan.Run`); a run's weights are stacked on a
leading axis (`runs/<r>/core/...` for every layer, `runs/<r>/<kind>/...` for each kind that has
CSA2 weights of its own, `runs/<r>/engram/...` for the run's Engram layer) and run under one
`lax.scan` whose body switches on the layer's kind. The Engram table lookup depends on the token ids
alone, and an Engram layer starts its run, so the lookup and the gated injection both run before
that run's scan and the body holds no Engram branch. The program therefore holds one layer body
per kind per run, whatever the depth: compile time and program size do not grow with
the number of layers. With `scan_layers=False` the same weights run unrolled (for tests). A
forward pass can stop after the encoder (CED prefill, §6).

Shapes: B batch, T sequence, N = hc_mult streams, D hidden, V vocab, L layers, E experts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import sharding
from dsv41_jax.block import (ATTENTION_PLAN, Context, LayerAux, LayerCore, Publisher, StreamState,
                             defer_output, layer_forward, prefill_kv, settle, site_input)
from dsv41_jax.config import ModelConfig
from dsv41_jax.layer_plan import LayerPlan, Run, build_layer_plan
from dsv41_jax.layers import mhc
from dsv41_jax.layers.attention import selection_plan
from dsv41_jax.layers.engram import Engram
from dsv41_jax.layers.moe_dispatch import GATE_UP as MOE_GATE_UP, KEPT as MOE_KEPT
from dsv41_jax.layers.norm import RMSNorm
from dsv41_jax.layers.types import CompressedKV
from pallas_kernels.ops.indexer import SELECTION
from pallas_kernels.ops.mhc import MIX
from pallas_kernels.ops.sparse_attention import OUTPUT as ATTENTION_OUTPUT


def remat_policy(prim, *args, **params) -> bool:
  """Layer remat (cfg.remat) recomputes a layer's forward in its backward except the outputs of
  `top_k` and the values named `SAVED_NAMES`: the indexer's selection and candidate pool (a sort
  of [T, N] scores per indexing layer, or the radix select; the kernel's scores at the selection,
  [B, T, K] float32, which the KL loss's backward reads), the attention op's plan of the
  selection (a sort of its slots), the MoE routing, the MoE layer's router logits, pair sort and
  output (`moe_dispatch.KEPT`: the output is what the mHC site's backward reads; recomputing it
  re-ran the down-projections and the combine), the attention kernel's output, log-sum-exp and
  global_probs (`ops.sparse_attention.OUTPUT`, [B, T, H, D] + [B, T, H] + [B, T, K] a layer: its
  backward reads them, so keeping them saves a second forward kernel per global layer) and each
  mHC site's mix product and mean square (`ops.mhc.MIX`, [.., (2+n)n] + [.., 1] per token;
  kernel: also its gate rows) are kept, not recomputed: the float32 mix GEMM and the mean square
  each read all n·d channels of the streams (docs/design.md §5.4)."""
  return prim.name == "top_k" or _saved_names(prim, *args, **params)


SAVED_NAMES = (ATTENTION_PLAN, SELECTION, MIX, MOE_KEPT, ATTENTION_OUTPUT)
_saved_names = jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES)
_saved_experts = jax.checkpoint_policies.save_only_these_names(MOE_GATE_UP)
_saved_projections = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def layer_remat_policy(saves: tuple[str, ...] = ()):
  """`remat_policy`, plus what `ModelConfig.remat_saves` names (`config.REMAT_SAVES`):
  "projections" keeps every dot_general without batch dimensions (the dense projections of
  attention, indexer, shared experts and Engram: their recompute is matrix work), "experts" the
  routed experts' gate|up grouped product (`moe_dispatch.GATE_UP`, [N·K, 2F] a layer in float32,
  or in the compute dtype with `moe_product_dtype="compute"`)."""
  saves = frozenset(saves)
  if not saves:
    return remat_policy
  extra = ([_saved_projections] if "projections" in saves else []) + (
      [_saved_experts] if "experts" in saves else [])

  def policy(prim, *args, **params) -> bool:
    return remat_policy(prim, *args, **params) or any(p(prim, *args, **params) for p in extra)

  return policy


def _stacked(make, n: int, rngs: nnx.Rngs):
  """`n` modules from `make(rngs)` with their parameters stacked on a leading axis."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=0, out_axes=0)
  def build(r: nnx.Rngs):
    return make(r)

  return build(rngs)


def _take(module: nnx.Module, i) -> nnx.Module:
  """Row `i` (an int or a traced index) of a stacked module."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


class RunStack(nnx.Module):
  """The weights of one run: `core` [n_layers, ...], one Publisher stack per publishing kind
  (attribute = the kind's name), and the Engram memory of the run's Engram layer, if any."""

  def __init__(self, cfg: ModelConfig, run: Run, rngs: nnx.Rngs):
    first = run.layers[0]
    self.core = _stacked(lambda r: LayerCore(cfg, first, r), run.n_layers, rngs)
    for k, spec in enumerate(run.kinds):
      if spec.owns_indexer:
        setattr(self, spec.kind_name,
                _stacked(lambda r, spec=spec: Publisher(cfg, spec, r), run.kind_count(k), rngs))
    if run.engram:
      self.engram = Engram(cfg, run.engram_layer, rngs=rngs, fp8_table=cfg.engram_fp8_table)

  def publishers(self, run: Run) -> list[Publisher | None]:
    return [getattr(self, s.kind_name) if s.owns_indexer else None for s in run.kinds]


class Transformer(nnx.Module):
  """Embedding → runs of scanned layers → final collapse, norm and head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.plan: LayerPlan = build_layer_plan(cfg)
    pd = jnp.dtype(cfg.param_dtype)
    self.embed = sharding.param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                sharding.normal(1.0), pd)
    self.runs = nnx.List([RunStack(cfg, run, rngs) for run in self.plan.runs])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs)
    self.head = sharding.param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                               sharding.fan_in_normal((0,)), pd)
    if cfg.vision is not None:  # the vision pathway (dsv41_jax/vision), params vision/, projector/
      from dsv41_jax.vision.projector import Projector
      from dsv41_jax.vision.vit import ViT
      self.vision = ViT(cfg.vision, rngs, dtype=cfg.dtype, param_dtype=pd)
      self.projector = Projector(cfg.vision, cfg.hidden_size, rngs, dtype=cfg.dtype, param_dtype=pd)

  # --- pieces -------------------------------------------------------------------------------

  def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
    cfg = self.cfg
    h = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cfg.dtype)
    # The looked-up rows first keep the table's split of d (`embed`, ZeRO-3 over fsdp), the batch
    # over the other batch axes, and only then take the hidden state's layout (the batch over all
    # of them). The constraint's transpose does the same to the gradient: the scatter-add into the
    # d-split table gets its rows split on d by an all-to-all over fsdp, where from the hidden
    # state's layout XLA's SPMD partitioner could only replicate the whole cotangent and slice it
    # again ("Involuntary full rematerialization", on a mesh with fsdp and another batch axis;
    # tests/dsv41_jax/test_sharding.py).
    h = sharding.constrain(h, ("batch", "seq", "embed"), first=("embed",))
    return sharding.constrain(h, ("batch", "seq", "embed"))

  def initial_state(self, h_BxTxD: jax.Array) -> StreamState:
    """X⁰ = the embedding broadcast to every stream; pre_mix = e_0 (docs/design.md §3.3). The
    plain residual has one stream (hc_mult 1), so pre_mix = e_0 = 1 reads it as it is."""
    n = self.cfg.hc_mult
    B, T, D = h_BxTxD.shape
    X = jnp.broadcast_to(h_BxTxD[:, :, None, :], (B, T, n, D)).astype(self.cfg.hc_stream_dtype)
    pre = jnp.broadcast_to(mhc.initial_pre(n), (B, T, n)).astype(jnp.float32)
    return StreamState(X, pre)

  def layer(self, index: int) -> tuple[LayerCore, Publisher | None, Engram | None]:
    """The weights of one layer, un-stacked: (core, publisher or None, Engram or None)."""
    r, i = self.plan.run_of(index)
    run, stack = self.plan.runs[r], self.runs[r]
    spec = run.kinds[run.kind_of[i]]
    pub = _take(getattr(stack, spec.kind_name), run.slot_of[i]) if spec.owns_indexer else None
    engram = stack.engram if index == run.engram_layer else None
    return _take(stack.core, i), pub, engram

  def run_layers(self, r: int, state: StreamState, ctx: Context,
                 moe_bias_Lx2xE: jax.Array) -> tuple[StreamState, LayerAux]:
    """Run the layers of run `r`; returns the new state and per-layer aux stacked in layer order."""
    cfg = self.cfg
    run, stack = self.plan.runs[r], self.runs[r]
    lo, n = run.first_layer, run.n_layers
    bias = moe_bias_Lx2xE[lo:lo + n]
    state = self._prepare_carry(run, state, ctx)
    if run.engram:
      # An Engram layer starts its run (`layer_plan`): the lookup and the gated injection run on
      # the streams the run starts from, under their own remat as the layers are.
      token_mask = (ctx.segment_ids_BxT > 0) & ~ctx.image_mask_BxT
      ids = ctx.engram_ids[run.engram_layer]
      memory_kv = stack.engram.memory(ids)
      touched = stack.engram.rows_touched(ids, token_mask) / stack.engram.num_rows
      inject = lambda X: stack.engram.inject(X, memory_kv, token_mask)
      if cfg.remat:
        inject = jax.checkpoint(inject, policy=layer_remat_policy(cfg.remat_saves))
      # Before the scan: no Engram branch in the body (a `lax.cond` on every layer cost ~5 ms a
      # micro-batch of s3 on the H200) and no slice of the run's stacks around the injection (an
      # injection inside a run cost 42 ms a step of s3 on an H100). It reads the streams whole.
      state = settle(state)
      X, gate = inject(state.X_BxTxNxD)
      state = state._replace(X_BxTxNxD=X)
    if cfg.single_pass_boundary and cfg.residual == "mhc":
      state = defer_output(cfg, state)
    pubs = stack.publishers(run)
    core_def, core_state = nnx.split(stack.core)
    pub_defs = [None if p is None else nnx.split(p)[0] for p in pubs]
    pub_states = [None if p is None else nnx.split(p)[1] for p in pubs]
    kind_of = np.asarray(run.kind_of, np.int32)
    slot_of = np.asarray(run.slot_of, np.int32)

    def body(carry, xs):
      core_p, pub_ps, bias_l, k = xs
      core = nnx.merge(core_def, core_p)
      ps = [None if d is None else nnx.merge(d, p) for d, p in zip(pub_defs, pub_ps)]
      return layer_forward(cfg, run.kinds, core, ps, carry, ctx, bias_l, k)

    if cfg.remat:
      body = jax.checkpoint(body, prevent_cse=False, policy=layer_remat_policy(cfg.remat_saves))
    if cfg.scan_layers and n > 1:
      # Each kind's weights gathered into one row per layer (rows of other kinds are never read;
      # the gather's transpose sums each layer's gradient back into its kind's stack).
      gathered = [None if p is None else jax.tree.map(
          lambda a, k=k: a[np.where(kind_of == k, slot_of, 0)], p)
          for k, p in enumerate(pub_states)]
      state, aux = jax.lax.scan(body, state, (core_state, gathered, bias, jnp.asarray(kind_of)))
    else:
      auxes = []
      for i in range(n):
        k, slot = run.kind_of[i], run.slot_of[i]

        def one(carry, core_p, pub_p, bias_l, k=k):
          # Unrolled, the kind is static: only the layer's own publisher weights are passed.
          ps = [None if pub_defs[k] is None else nnx.merge(pub_defs[k], pub_p)]
          return layer_forward(cfg, [run.kinds[k]], nnx.merge(core_def, core_p), ps, carry, ctx,
                               bias_l)

        if cfg.remat:
          one = jax.checkpoint(one, prevent_cse=False,
                               policy=layer_remat_policy(cfg.remat_saves))
        pub_p = None if pub_states[k] is None else jax.tree.map(lambda a: a[slot], pub_states[k])
        state, a = one(state, jax.tree.map(lambda a: a[i], core_state), pub_p, bias[i])
        auxes.append(a)
      aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    if run.engram:   # the Engram layer's figures (its run's first row)
      put = lambda a, v: a.at[0].set(v.astype(a.dtype))
      aux = aux._replace(engram_gate_N=put(aux.engram_gate_N, gate),
                         engram_rows_touched=put(aux.engram_rows_touched, touched))
    return state, aux

  def _prepare_carry(self, run: Run, state: StreamState, ctx: Context) -> StreamState:
    """Give the carry the CSA2 fields a run's layers produce, so scan sees a fixed structure."""
    cfg = self.cfg
    first = run.layers[0]
    if not first.reads_global_kv:
      return StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN, pending=state.pending)
    B, T = ctx.segment_ids_BxT.shape
    n_entries = first.entries(T)
    kv, topk, cand, plan = state.kv, state.topk_BxTxK, state.candidate, state.attn_plan
    if kv is None or kv.main_kv_BxNxD.shape[1] != n_entries:
      if not first.owns_compressor:
        raise ValueError(f"layer {first.index} ({first.mode}) has no compressed KV to read")
      dt = jnp.dtype(cfg.dtype)
      kv = CompressedKV(
          jnp.zeros((B, n_entries, cfg.head_dim), dt),
          jnp.zeros((B, n_entries, cfg.index_head_dim), dt),
          jnp.full((B, n_entries), -1, jnp.int32), jnp.zeros((B, n_entries), jnp.int32),
          jnp.zeros((B, n_entries), jnp.int32))
      topk = cand = plan = None
    if topk is None:
      topk = jnp.full((B, T, min(cfg.index_topk, n_entries)), -1, jnp.int32)
      # Zeros are the plan of the empty selection (no entry has a slot); the run's first layer
      # publishes its own before its attention reads one.
      shapes = jax.eval_shape(lambda t: selection_plan(cfg, kv, t, ctx.segment_ids_BxT), topk)
      plan = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    if cand is None and any(l.candidate_role == "source" for l in run.layers):
      from dsv41_jax.layers.indexer import empty_candidate
      cand = empty_candidate(cfg, B, T, n_entries)
    return StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN, kv, topk, cand, plan, state.pending)

  # --- forward ------------------------------------------------------------------------------

  def __call__(self, batch: dict[str, jax.Array], moe_bias_Lx2xE: jax.Array, *,
               stop_after_encoder: bool = False,
               input_embeddings_BxTxD: jax.Array | None = None,
               train_vit: bool = True, return_hidden: bool = False) -> tuple[Any, dict[str, Any]]:
    """Logits [B, T, V] (or, with `stop_after_encoder`, the prefill dict; with `return_hidden`,
    the head's input and weight `(x_BxTxD, head_DxV)`, for `loss.head_cross_entropy`) and aux.

    `batch` holds `tokens`, `positions`, `segment_ids` ([B, T] int32), optionally `image_mask`
    (bool) and `engram_ids` (dict layer → [B, T, H] int32 rows from `dsv41_jax.engram`).
    `input_embeddings_BxTxD` replaces the token embedding. Otherwise, with `cfg.vision` set and
    `images`, `image_cells`, `image_starts`, `image_count` in the batch (`data/packing.py`), the
    image spans get the vision pathway's embeddings (`dsv41_jax.vision.pathway`); `train_vit=False`
    (static) keeps every gradient out of the ViT while it is frozen.
    """
    cfg = self.cfg
    tokens = batch["tokens"]
    ctx = Context(batch["positions"].astype(jnp.int32), batch["segment_ids"].astype(jnp.int32),
                  batch.get("image_mask", jnp.zeros(tokens.shape, bool)).astype(bool),
                  dict(batch.get("engram_ids", {})))
    h = self.embed_tokens(tokens) if input_embeddings_BxTxD is None else input_embeddings_BxTxD
    if input_embeddings_BxTxD is None and cfg.vision is not None and "images" in batch:
      from dsv41_jax.vision.pathway import embed_with_images
      h = embed_with_images(self.vision, self.projector, h, batch, train_vit=train_vit)
    state = self.initial_state(h)
    auxes = []
    n_enc = self.plan.num_encoder_layers
    for r, run in enumerate(self.plan.runs):
      if run.first_layer == n_enc:
        state = settle(state)
        enc_state = StreamState(state.X_BxTxNxD, state.pre_mix_BxTxN)
        if stop_after_encoder:
          return self._prefill_outputs(enc_state, ctx), _collect(auxes)
        # The decoder reads its own compressed KV, never the encoder's.
        state = enc_state
        ctx = Context(ctx.positions_BxT, ctx.segment_ids_BxT, ctx.image_mask_BxT, ctx.engram_ids,
                      encoder_final=enc_state if cfg.kv_source_input == "encoder_final" else None)
      state, aux = self.run_layers(r, state, ctx, moe_bias_Lx2xE)
      auxes.append(aux)
    state = settle(state)
    x = site_input(cfg, self.final_norm, state.X_BxTxNxD, state.pre_mix_BxTxN)
    if return_hidden:
      return (x, self.head[...]), _collect(auxes)
    logits = jnp.einsum("btd,dv->btv", x, self.head[...].astype(cfg.dtype),
                        preferred_element_type=jnp.float32)
    return logits, _collect(auxes)

  def _prefill_outputs(self, enc: StreamState, ctx: Context) -> dict[str, Any]:
    """H_{L/2} and the decoder KV sources that project from it (docs/design.md §6): the first decoder
    layer when it is a Full layer (its attention input is H_{L/2}) and every Full layer whose
    `kv_input` is "encoder_final" (`LayerSpec.prefills_from_encoder`)."""
    out: dict[str, Any] = {"encoder_state": enc, "decoder_kv": {}}
    for spec in self.plan.layers:
      if spec.prefills_from_encoder:
        core, pub, _ = self.layer(spec.index)
        out["decoder_kv"][spec.index] = prefill_kv(self.cfg, core, pub, enc, ctx)
    return out


def _collect(auxes: list[LayerAux]) -> dict[str, jax.Array]:
  if not auxes:
    return {}
  aux = jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)
  return aux._asdict()


# --- construction helpers ---------------------------------------------------------------------

def zero_moe_bias(cfg: ModelConfig) -> jax.Array:
  """The routing bias [L, 2 (text, image), E]: not a parameter, updated by the train loop."""
  return jnp.zeros((cfg.num_hidden_layers, 2, cfg.n_routed_experts), jnp.float32)


def abstract_model(cfg: ModelConfig) -> Transformer:
  """The model with ShapeDtypeStruct leaves: no allocation (for the ledger and sharding plans)."""
  return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))


def abstract_params(cfg: ModelConfig) -> nnx.State:
  """The parameter `nnx.State` of the model, as ShapeDtypeStructs."""
  return nnx.state(abstract_model(cfg), nnx.Param)


def init_model(cfg: ModelConfig, seed: int = 0, mesh: jax.sharding.Mesh | None = None
               ) -> Transformer:
  """Initialise the model; with a mesh, every parameter is created directly with its sharding."""
  if mesh is None:
    return Transformer(cfg, nnx.Rngs(seed))
  gdef, abs_state = nnx.split(abstract_model(cfg))
  shardings = sharding.state_shardings(abs_state, mesh)
  # The seed is the program's argument, not a constant in it: every seed of a config runs one
  # program (a persistent compilation cache hit for a run's second seed), with the same draws.
  init = jax.jit(lambda key: nnx.split(Transformer(cfg, nnx.Rngs(key)))[1],
                 out_shardings=shardings)
  options = _CPU_INIT_OPTIONS if mesh.devices.flat[0].platform == "cpu" else {}
  key = jax.random.key(seed)
  return nnx.merge(gdef, init.trace(key).lower().compile(compiler_options=options)(key))


# The init program runs once per run. On the CPU, LLVM's optimisation of its random-number code is
# most of a cold start (configs/tiny.py: 51 s of compile on 2 busy cores, 9.6 s without it) and buys
# nothing at run time (the program runs in milliseconds). The draws stay exact integer threefry; the
# float transforms after them may round differently from an optimised build (another valid draw).
_CPU_INIT_OPTIONS = {"xla_backend_optimization_level": 0}


def param_count(state: nnx.State) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
