"""benchmarks/gpu_profile.py's sources beyond an instruction's own innermost frame: the whole
StackFrames chain, instructions whose tuple shape carries `/*index=N*/` comments, and the source an
XLA-made instruction (a fusion with empty metadata, an inserted copy) takes from the code it serves
(its fused root, its operand, the loop that runs it)."""

import jax
import jax.numpy as jnp

from benchmarks import gpu_profile

_HERE = "tests/benchmarks/test_gpu_profile_sources.py"


def _line(text: str) -> int:
  return next(i + 1 for i, l in enumerate(open(__file__).read().splitlines())
              if text in l and "_line(" not in l)


def _inner(x):
  return jnp.sin(x) * 3.0


def _outer(x):
  return _inner(x) + 1.0


def _repo_frames(hlo, op):
  return [(p[len(gpu_profile._REPO):], fn, ln) for p, fn, ln in hlo.frames(op)
          if p.startswith(gpu_profile._REPO)]


def test_frames_follow_the_whole_call_chain():
  """The table prints each parent one row above it; read literally every chain stopped after one
  or two frames (the outermost named itself as parent), so an op made inside a library (optax's
  tree norm) never reached the repository frame that called it."""
  hlo = gpu_profile.HloSources(jax.jit(_outer).lower(jnp.ones(8)).compile().as_text())
  sines = [op for op, (kind, name, _) in hlo.ops.items() if name.endswith("/sin")]
  assert sines
  frames = _repo_frames(hlo, sines[0])
  assert frames[:3] == [(_HERE, "_inner", _line("jnp.sin(x) * 3.0")),
                        (_HERE, "_outer", _line("_inner(x) + 1.0")),
                        (_HERE, "test_frames_follow_the_whole_call_chain",
                         _line("jax.jit(_outer).lower"))]


def test_instructions_with_index_comments_in_their_shape_resolve():
  """A tuple of six or more shapes prints `/*index=5*/` (an `=` the first pattern stopped at)."""
  def f(a, b, c, d, e, g):
    return jax.lax.fori_loop(0, 3, lambda i, t: tuple(x * 2.0 for x in t), (a, b, c, d, e, g))

  hlo = gpu_profile.HloSources(jax.jit(f).lower(*[jnp.ones(4)] * 6).compile().as_text())
  loops = [op for op in hlo.ops if hlo.kind(op) == "while"]
  assert loops
  assert _repo_frames(hlo, loops[0])[0] == (
      _HERE, "test_instructions_with_index_comments_in_their_shape_resolve.<locals>.f",
      _line("return jax.lax.fori_loop(0, 3"))


_SYNTHETIC = """HloModule m

FileNames
1 "{repo}pkg/a.py"
FunctionNames
1 "outer"
2 "inner"
FileLocations
1 {{file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}}
2 {{file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=2}}
StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=2}}

%fused_add (p0: f32[4]) -> f32[4] {{
  %p0 = f32[4]{{0}} parameter(0)
  %mul.1 = f32[4]{{0}} multiply(%p0, %p0)
  ROOT %add.1 = f32[4]{{0}} add(%mul.1, %p0), metadata={{op_name="jit(f)/add" stack_frame_id=2}}
}}

%body (b: f32[4]) -> f32[4] {{
  %b = f32[4]{{0}} parameter(0)
  ROOT %copy.9 = f32[4]{{0}} copy(%b), metadata={{scheduling_name="copy.9"}}
}}

%condition (c: f32[4]) -> pred[] {{
  %c = f32[4]{{0}} parameter(0)
  ROOT %false = pred[] constant(false)
}}

ENTRY %main (x: f32[4]) -> (f32[4], f32[4]) {{
  %x = f32[4]{{0}} parameter(0)
  %while.1 = f32[4]{{0}} while(%x), condition=%condition, body=%body, metadata={{op_name="jit(f)/while" stack_frame_id=1}}
  %loop_add_fusion = f32[4]{{0}} fusion(%x), kind=kLoop, calls=%fused_add, metadata={{scheduling_name="loop_add_fusion"}}
  %copy.3 = f32[4]{{0}} copy(%loop_add_fusion), metadata={{scheduling_name="copy.3"}}
  %copy.4 = f32[4]{{0}} copy(%x)
  ROOT %tuple = (f32[4]{{0}}, f32[4]{{0}}, f32[4]{{0}}) tuple(%loop_add_fusion, %copy.3, %copy.4)
}}
"""


def test_xla_made_instructions_take_the_source_they_serve():
  hlo = gpu_profile.HloSources(_SYNTHETIC.format(repo=gpu_profile._REPO))
  chain = [(gpu_profile._REPO + "pkg/a.py", "inner", 20), (gpu_profile._REPO + "pkg/a.py", "outer", 10)]
  assert hlo.frames("add.1") == chain
  assert hlo.own_frames("loop_add_fusion") == [] and hlo.frames("loop_add_fusion") == chain
  assert hlo.own_frames("copy.3") == [] and hlo.frames("copy.3") == chain   # via its operand
  assert hlo.kind("copy.4") == "copy" and hlo.frames("copy.4") == []        # a parameter's: none
  assert hlo.frames("copy.9") == chain[1:]                                   # its loop's
  assert hlo.kind("nothing") == "?"
  # Kernel events: the copy is charged to its operand's line; an event naming no instruction
  # keeps its kernel name.
  spans = [dict(ph="X", pid=1, tid=1, ts=0, dur=4000, args=dict(hlo_op="copy.3"), name="copy"),
           dict(ph="X", pid=1, tid=1, ts=0, dur=2000, args={}, name="memset32_aligned1D")]
  groups = gpu_profile.attribute(spans, hlo, steps=2)
  assert groups["line"] == {"copy pkg/a.py:20 (inner)": 2.0,
                            "? memset32_aligned1D (hlo_op '')": 1.0}
