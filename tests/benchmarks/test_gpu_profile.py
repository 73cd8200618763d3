"""benchmarks/gpu_profile.py's attribution: compiled HLO instruction → source frame → component."""

import ast

import jax
import jax.numpy as jnp

from benchmarks import gpu_profile


def _layer(x, w):
  return jnp.tanh(x @ w).sum()


def test_instructions_resolve_to_their_source_line_and_component():
  text = jax.jit(jax.grad(_layer)).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
  hlo = gpu_profile.HloSources(text)
  dots = [op for op, (_, name, _) in hlo.ops.items() if name.endswith("/dot_general")]
  assert dots
  here = [l for l in open(__file__).read().splitlines()]
  line = next(i + 1 for i, l in enumerate(here) if "jnp.tanh(x @ w)" in l)
  for op in dots:
    path, fn, ln = gpu_profile.repo_frame(hlo.frames(op))
    assert (path, fn, ln) == ("tests/benchmarks/test_gpu_profile.py", "_layer", line)
  assert gpu_profile.component(("optim/muon.py", "_iterate", 3)) == "optimizer"
  assert gpu_profile.component(("dsv41_jax/layers/mhc.py", "expand", 3)) == "mHC"
  assert gpu_profile.component(None) == "other"
  spans = [dict(ph="X", pid=1, tid=1, ts=0, dur=2000, args=dict(hlo_op=dots[0])),
           dict(ph="X", pid=1, tid=2, ts=1000, dur=2000, args=dict(hlo_op="unknown"))]
  trace = dict(traceEvents=[dict(ph="M", name="process_name", pid=1,
                                 args=dict(name="/device:GPU:0")), *spans])
  events, busy = gpu_profile.gpu_kernels(trace)
  assert len(events) == 2 and busy == 3000   # the union of [0, 2000] and [1000, 3000] µs
  groups = gpu_profile.attribute(events, hlo, steps=2)
  assert groups["component"] == {"other": 2.0}   # 4 ms of kernels over 2 steps, neither in a rule
  assert groups["function"]["tests/benchmarks/test_gpu_profile.py:_layer"] == 1.0


def test_tuple_shaped_instructions_resolve_too():
  """A sort's (and a cuBLAS GEMM's) instruction has a tuple shape, `(f32[..], s32[..]) sort(...)`;
  it must resolve like any other (the first GPU profile left 41 % of kernel time unattributed)."""
  text = jax.jit(lambda x: jnp.argsort(x, axis=-1)).lower(jnp.ones((8, 8))).compile().as_text()
  hlo = gpu_profile.HloSources(text)
  sorts = [op for op in hlo.ops if hlo.kind(op) == "sort"]
  assert sorts and all(hlo.frames(op) for op in sorts)
  line = next(i + 1 for i, l in enumerate(open(__file__).read().splitlines())
              if "jnp.argsort(x, axis=-1)" in l and "next(" not in l)
  assert ("tests/benchmarks/test_gpu_profile.py",
          "test_tuple_shaped_instructions_resolve_too.<locals>.<lambda>",
          line) == gpu_profile.repo_frame(hlo.frames(sorts[0]))


def test_without_a_gpu_it_says_so_and_exits_2(capsys):
  assert gpu_profile.main([]) == 2
  out = capsys.readouterr().out.strip().splitlines()
  assert len(out) == 1 and out[0].startswith("error: gpu_profile needs a GPU")


_KINDS_HLO = """\
ENTRY %main.1 (p.1: f32[8,8]) -> f32[8,8] {
  %p.1 = f32[8,8]{1,0} parameter(0)
  %custom-call.7 = (f32[8,8]{1,0}, s8[64]{0}) custom-call(%p.1, %p.1), custom_call_target="__cublas$lt$matmul"
  %gemm_fusion_dot.12 = bf16[8,8]{1,0} fusion(%p.1, %p.1), kind=kCustom, calls=%gemm_fusion_dot.12_computation
  %pallas_call.3 = f32[8,8]{1,0} custom-call(%p.1), custom_call_target="__gpu$xla.gpu.triton"
  %mpmd_map.2 = f32[8,8]{1,0} custom-call(%p.1), custom_call_target="mosaic_gpu_v2"
  %custom-call.9 = (s32[8]{0}, s32[8]{0}) custom-call(%p.1), custom_call_target="xla.gpu.ext.cub_sort_pairs"
  %input_scatter_fusion.4 = f32[8,8]{1,0} fusion(%p.1), kind=kInput, calls=%fused_scatter.4
  %loop_convert_gather_fusion.2 = bf16[8,8]{1,0} fusion(%p.1), kind=kLoop, calls=%fused_gather.2
  %loop_broadcast_fusion.272 = bf16[10,8,8]{2,1,0} fusion(), kind=kLoop, calls=%fused_broadcast.272
  %copy.590 = f32[8,8]{0,1} copy(%p.1)
  %loop_transpose_fusion.1 = f32[8,8]{1,0} fusion(%p.1), kind=kLoop, calls=%fused_transpose.1
  %loop_dynamic_update_slice_fusion.64 = f32[10,8,8]{2,1,0} fusion(%p.1), kind=kLoop, calls=%fused_dus.64
  %input_concatenate_fusion.68 = f32[8,16]{1,0} fusion(%p.1, %p.1), kind=kInput, calls=%fused_concatenate.68
  %input_reduce_fusion.177 = f32[8]{0} fusion(%p.1), kind=kInput, calls=%fused_reduce.177
  %triton_softmax.49 = f32[8,8]{1,0} fusion(%p.1), kind=kCustom, calls=%triton_softmax_computation.49
  %all-reduce.5 = f32[8,8]{1,0} all-reduce(%p.1), replica_groups={}, to_apply=%add
  %loop_select_fusion.33 = f32[8,8]{1,0} fusion(%p.1), kind=kLoop, calls=%fused_select.33
  ROOT %wrapped_add.3 = f32[8,8]{1,0} fusion(%p.1, %p.1), kind=kLoop, calls=%wrapped_add_computation.3
}
"""


def test_work_kinds_from_xla_names_and_custom_call_targets():
  """Each instruction lands in the work kind its XLA name or custom-call target says; an event
  whose instruction the text does not hold is read by its name; the report prints the table."""
  hlo = gpu_profile.HloSources(_KINDS_HLO)
  want = {"custom-call.7": "GEMM", "gemm_fusion_dot.12": "GEMM",
          "pallas_call.3": "kernels (Pallas, Mosaic)", "mpmd_map.2": "kernels (Pallas, Mosaic)",
          "custom-call.9": "sort", "input_scatter_fusion.4": "scatter",
          "loop_convert_gather_fusion.2": "gather", "loop_broadcast_fusion.272": "fills",
          "copy.590": "copies, transposes", "loop_transpose_fusion.1": "copies, transposes",
          "loop_dynamic_update_slice_fusion.64": "stack writes",
          "input_concatenate_fusion.68": "concatenates", "input_reduce_fusion.177": "reductions",
          "triton_softmax.49": "reductions", "all-reduce.5": "collectives",
          "loop_select_fusion.33": "elementwise", "wrapped_add.3": "elementwise", "p.1": "other"}
  assert {op: gpu_profile.work_kind(hlo, op) for op in want} == want
  assert gpu_profile.work_kind(hlo, "loop_dynamic_update_slice_fusion.245") == "stack writes"
  spans = [dict(ph="X", pid=1, ts=0, dur=3000, args=dict(hlo_op="loop_broadcast_fusion.272")),
           dict(ph="X", pid=1, ts=0, dur=1000, args=dict(hlo_op="custom-call.7")),
           dict(ph="X", pid=1, ts=0, dur=1000, args=dict())]
  groups = gpu_profile.attribute(spans, hlo, steps=1)
  assert groups["work"] == {"fills": 3.0, "GEMM": 1.0, "other": 1.0}
  text = gpu_profile.report(groups, step_ms=10.0, busy_ms=5.0, top=3)
  assert "| fills | 3.0 | 60.0% |" in text and "| GEMM | 1.0 | 20.0% |" in text


def test_reread_classes_a_stored_profile(tmp_path):
  """`--reread` reads a stored `--json` profile's instructions back and prints its work kinds."""
  import json
  path = tmp_path / "prof.json"
  path.write_text(json.dumps(dict(
      groups=dict(component={"MoE": 3.0, "other": 1.0}),
      ops={"loop_broadcast_fusion.1": dict(ms=1.0, text="%loop_broadcast_fusion.1 = f32[8]{0} "
                                                       "fusion(), kind=kLoop"),
           "custom-call.2": dict(ms=2.0, text='%custom-call.2 = f32[8]{0} custom-call(%p), '
                                            'custom_call_target="__cublas$lt$matmul"')})))
  text = gpu_profile.reread(str(path))
  assert "3.0 of 4.0 ms" in text and "| GEMM | 2.0 | 50.0% |" in text
  assert "| fills | 1.0 | 25.0% |" in text


def test_reread_recomputes_components_by_todays_rules_with_renamed_lines():
  """A stored profile's (op kind, file:line) totals give today's component table; a line whose
  code now sits in another function is named by `renames` (session 55 re-read sessions 45-54's
  profiles this way: the collapse inline in `layer_forward` is mHC's)."""
  lines = {"fusion dsv41_jax/block.py:129 (site_output)": 2.0,
           "fusion dsv41_jax/block.py:205 (layer_forward)": 1.5,
           "fusion dsv41_jax/block.py:210 (layer_forward)": 0.25,
           "custom-call optim/muon.py:185 (_iterate.<locals>.<lambda>)": 4.0,
           "? some_kernel (hlo_op 'x')": 0.5}
  got = gpu_profile.recomponent(lines, {"dsv41_jax/block.py:205": "site_input"})
  assert got == {"mHC": 3.5, "dense": 0.25, "optimizer": 4.0, "other": 0.5}
  assert gpu_profile.recomponent(lines)["dense"] == 1.75


def test_issue_26_measure_is_the_attention_op_and_the_indexer():
  """Issue 26 measured the attention op and the indexer, not the layer's projections or RoPE: the
  op's kernels, its XLA form, the selection's visibility and block.py's call (the custom VJP's
  frame) count; `Attention.output`, RoPE and the compressor stay outside, each once."""
  lines = {"custom-call pallas_kernels/csa2_attention.py:450 (sparse_attend)": 4.0,
           "fusion pallas_kernels/ops/sparse_attention.py:144 (_attend_blocks)": 0.5,
           "fusion dsv41_jax/layers/attention.py:42 (visible_topk.<locals>.<lambda>)": 0.25,
           "fusion dsv41_jax/block.py:240 (attend)": 0.125,
           "custom-call dsv41_jax/layers/attention.py:132 (Attention.output)": 2.0,
           "fusion dsv41_jax/layers/rope.py:69 (apply_rope)": 1.0,
           "fusion dsv41_jax/layers/compressor.py:103 (compress)": 1.0,
           "custom-call pallas_kernels/indexer.py:409 (score_and_select.<locals>.<lambda>)": 3.0}
  assert gpu_profile.attention_op_ms(lines) == 4.875
  comp = gpu_profile.recomponent(lines)
  assert comp["attention"] == 8.875 and comp["indexer"] == 3.0
  got = gpu_profile.issue_lines(comp, lines)
  assert got[0].startswith("issue 26: attention op + indexer 7.9 ms (op 4.9, indexer 3.0; ")
  assert "other 4.0 ms" in got[0]


_LAYER_CALLS = {"mhc": "mHC", "site": "mHC", "attn": "attention", "indexer_kl_loss": "indexer"}


def _calls_with_qualnames(tree):
  """(callee name, qualified name of the enclosing function as a frame spells it, line) of every
  call in a module: `f.<locals>.g`, `Class.method`, `f.<locals>.<lambda>`."""
  out = []

  def visit(node, qual):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        name = child.name if not isinstance(child, ast.Lambda) else "<lambda>"
        inner = name if not qual else (f"{qual}.{name}" if isinstance(node, ast.ClassDef)
                                       else f"{qual}.<locals>.{name}")
        visit(child, inner)
      elif isinstance(child, ast.ClassDef):
        visit(child, child.name if not qual else f"{qual}.<locals>.{child.name}")
      else:
        if isinstance(child, ast.Call):
          f = child.func
          callee = (f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and f.value.id == "mhc" and f.attr[0].islower()   # not mhc.MHCSite(...)
                    else f.attr if isinstance(f, ast.Attribute)
                    else f.id if isinstance(f, ast.Name) else None)
          out.append((callee, qual, child.lineno))
        visit(child, qual)

  visit(tree, "")
  return out


def test_block_calls_into_the_layers_sit_where_the_rules_name_their_component():
  """A custom VJP's operations (mhc.expand, collapse, the attention op) carry the frame of the
  line that calls them, so block.py's own functions decide their component. Until session 55 the
  collapse ran inline in `layer_forward` and no rule named `site_output` / `next_site`: ~20 ms of
  s3's mHC per step (H100) was counted as dense. Each call of block.py into mHC, the attention or
  the indexer loss must resolve, by its enclosing function, to that component."""
  import dsv41_jax.block as block
  path = "dsv41_jax/block.py"
  calls = _calls_with_qualnames(ast.parse(open(block.__file__).read()))
  checked = [(callee, qual, line) for callee, qual, line in calls
             if callee in _LAYER_CALLS and qual]
  assert {c for c, _, _ in checked} == set(_LAYER_CALLS), checked   # the census sees all four
  wrong = [(callee, qual, line, gpu_profile.component((path, qual, line)))
           for callee, qual, line in checked
           if gpu_profile.component((path, qual, line)) != _LAYER_CALLS[callee]]
  assert not wrong, wrong
  # The rules themselves: inlined into layer_forward, the same calls would count as dense.
  assert gpu_profile.component((path, "layer_forward", 1)) == "dense"


# Modules whose kernels have no component of their own: the dispatcher and its helpers, and the
# QAT fake-quantizers (called from the attention, the indexer and the experts alike; off by
# default, so "other" in the default step's table).
_NO_COMPONENT = {"pallas_kernels/__init__.py", "pallas_kernels/dispatch.py",
                 "pallas_kernels/notices.py", "pallas_kernels/sharded.py",
                 "pallas_kernels/fake_quant.py", "pallas_kernels/ops/__init__.py",
                 "pallas_kernels/ops/paths.py", "pallas_kernels/ops/quant.py"}


def test_every_kernel_module_has_a_component():
  """Session 58 made the Triton select the indexer's default, but its module had no rule: its
  1.8 ms a micro-batch (s3, H100) went to "other" and issue 26's indexer row read short."""
  import pathlib
  import pallas_kernels
  root = pathlib.Path(pallas_kernels.__file__).parent
  files = sorted(str(p.relative_to(root.parent)) for p in root.rglob("*.py"))
  missing = [f for f in files if f not in _NO_COMPONENT
             and gpu_profile.component((f, "f", 1)) == "other"]
  assert not missing, missing
