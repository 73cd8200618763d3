"""The train step's program, read on the CPU: no scatter, sort or float32 GEMM beyond a commented
allow-list (issue 28: the speed of the GPU step guarded without a GPU; `launch/hlo_sites.py`).

The Sinkhorn `segment_sum` that was a third of the s3 step on the H200 was one scatter in the
lowered program; a test like this one would have named its source line. Lowering s1's step
only traces (no XLA compile), so it costs seconds.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import small
from launch import hlo_sites, setup

# (kind, innermost function) → why it may stay. Keyed by function, not file and line, so moving
# code between modules keeps the entry; the failure message gives file and line.
ALLOWED = {
    # Scatters: integer bookkeeping or the transposes of gathers over small or sharded operands.
    ("scatter", "_Plan.__init__"): "Engram exchange plan: owner counts (int32, [devices + 1])",
    ("scatter", "_Plan.send"): "Engram exchange: unique ids to their owner's send buffer (int32)",
    ("scatter", "engram_lookup.<locals>.body"): "the Engram rows' gradient into the local shard",
    ("scatter", "select_topk"): "top-k slots to their entry mask (bool)",
    ("scatter", "initial_pre"): "the one-hot e_0 pre-mix ([hc_mult])",
    ("scatter", "route"): "routed-expert load counts (int32, [E])",
    ("scatter", "_capacity_local"): "capacity dispatch into expert buffers (issue 27: dropless)",
    ("scatter", "_sort_pairs"): "dropless dispatch: the inverse permutation (int32, no collisions)",
    ("scatter", "_dropless_local"): "dropless dispatch: the routing weights' gradient back to "
                                    "their (token, slot) pairs ([N·k])",
    ("scatter", "selected_mask.<locals>.<lambda>"): "masked global attention's entry mask "
                                                    "(issue 26: the sparse kernel)",
    ("scatter", "cross_entropy"): "the target logit's cotangent, one per token",
    ("scatter", "Transformer.embed_tokens"): "the embedding table's gradient (rows by token)",
    ("scatter", "Transformer.run_layers"): "the MoE bias rows of a scanned run",
    ("scatter", "Transformer.run_layers.<locals>.<lambda>"):
        "per-layer parameters written back into their scanned run",
    # Sorts and top-k.
    ("sort", "_Plan.__init__"): "jnp.unique of a device's Engram ids",
    ("sort", "distinct_rows_per_row"): "distinct Engram rows per row (a logged metric)",
    ("sort", "_sort_pairs"): "dropless dispatch: pairs by expert (stable argsort of int32)",
    ("top_k", "select_topk"): "the indexer's top-k (issue 26: a threshold select)",
    ("top_k", "route"): "the router's top-k over n_routed_experts",
    # Float32 GEMMs.
    ("f32_dot", "compress"): "CSA2 compressor softmax pooling over m = 2 groups",
    ("f32_dot", "indexer_scores"): "indexer logits (issue 26: fused scoring)",
    ("f32_dot", "engram_gate"): "Engram's gate reads the float32 mHC streams (issue 28)",
    ("f32_dot", "hc_mix"): "mHC coefficient projections, hc_coefficients' mix (issue 27)",
    ("f32_dot", "MoE.__call__"): "the float32 router (docs/design.md §6)",
    ("f32_dot", "grouped_matmul"): "lowered on the CPU the grouped product is ragged_dot, whose "
                                   "backward takes the float32 cotangent; the GPU runs the "
                                   "Mosaic kernel with its own backward (issue 27)",
    ("f32_dot", "_attend_blocks"): "masked global attention (issue 26)",
    ("f32_dot", "Transformer.__call__"): "the head's backward on float32 logit cotangents "
                                         "(issue 28: chunked cross-entropy)",
    ("f32_dot", "newton_schulz.<locals>.<lambda>"): "Newton-Schulz's last step in float32",
    ("f32_dot", "_Blocks.weighted_column_sums"): "Sinkhorn's one-hot block column sums, exact "
                                                 "in float32 by design (docs/design.md §T4)",
}


@pytest.fixture(scope="module")
def s1_sites():
  cfg = small.get_config("s1")
  cfg.model.vision = None   # as benchmarks/gpu_step.py: text rows, the ViT frozen for most of a run
  cfg.optim.frozen, cfg.optim.unfreeze_at = (), "never"
  cfg.optim.newton_schulz = "kernel"   # bfloat16, what "auto" takes on a GPU (float32 on the CPU)
  run = setup.run_config(cfg, process_count=1)
  mesh = setup.build_mesh(run.mesh, jax.devices()[:1])
  ts = setup.abstract_state(run, mesh)
  batch = setup.abstract_batch(run.model, run.data, run.data.batch_size)
  with jax.set_mesh(mesh):
    lowered = setup.train_step_jit(run, ts).lower(ts.state, batch, False)
  return hlo_sites.sites(lowered.as_text(debug_info=True))


def test_s1_train_step_has_no_scatter_sort_or_f32_gemm_off_the_allow_list(s1_sites):
  assert s1_sites, "the census found nothing: the lowered text lost its locations?"
  assert all(s.file != "?" for s in s1_sites), [s for s in s1_sites if s.file == "?"]
  new = collections.defaultdict(list)
  for s in s1_sites:
    if (s.kind, s.function) not in ALLOWED:
      new[(s.kind, s.function)].append(s)
  assert not new, "ops off the allow-list (fix them, or add a commented entry):\n" + "\n".join(
      f"  {kind} in {fn}: {len(ss)}× at {ss[0].where()}, size {max(x.size for x in ss):.3g}, "
      f"op {ss[0].op}" for (kind, fn), ss in new.items())


def _planted(x_NxD, w_DxD, ids_N):
  y = jax.ops.segment_sum(x_NxD, ids_N, num_segments=8)            # a scatter-add
  order = jnp.sort(x_NxD[:, 0])                                       # a full sort
  z = jnp.dot(x_NxD, w_DxD, precision=jax.lax.Precision.HIGHEST)      # 2·256·256·256 > 1e7 FLOP
  top = [(lambda v: jax.lax.top_k(v, 2)[0])(x_NxD) for _ in range(1)]  # a lambda in a listcomp
  return y.sum() + order.sum() + z.sum() + top[0].sum()


def test_census_names_planted_ops_with_their_source_lines():
  """A planted segment_sum, full sort, float32 GEMM and top-k are each found at their own line;
  the top-k's function reads the same on Python 3.11 and 3.12 (no `<listcomp>` frame)."""
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  ids = jax.ShapeDtypeStruct((256,), jnp.int32)
  text = jax.jit(jax.value_and_grad(_planted)).lower(x, x, ids).as_text(debug_info=True)
  found = {(s.kind, s.function, s.file, s.line) for s in hlo_sites.sites(text)}
  src = open(__file__).read().splitlines()
  line = lambda needle: next(i + 1 for i, l in enumerate(src) if needle in l and "line(" not in l)
  here = "tests/launch/test_step_program.py"
  assert ("scatter", "_planted", here, line("segment_sum(x_NxD")) in found, found
  assert ("sort", "_planted", here, line("jnp.sort(x_NxD")) in found, found
  assert ("f32_dot", "_planted", here, line("jnp.dot(x_NxD")) in found, found
  assert ("top_k", "_planted.<locals>.<lambda>", here, line("top_k(v, 2)")) in found, found
  # The same GEMM in bf16 is not a float32 GEMM, nor is a small float32 one.
  bf16 = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
  text = jax.jit(lambda a, b: jnp.dot(a, b)).lower(bf16, bf16).as_text(debug_info=True)
  small_text = jax.jit(lambda a, b: jnp.dot(a, b)).lower(
      jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((16, 16), jnp.float32)
  ).as_text(debug_info=True)
  assert not hlo_sites.sites(text) and not hlo_sites.sites(small_text)
  assert np.isclose([s.size for s in hlo_sites.sites(
      jax.jit(jnp.dot).lower(x, x).as_text(debug_info=True))], 2 * 256 ** 3).all()
