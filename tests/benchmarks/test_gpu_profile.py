"""benchmarks/gpu_profile.py's attribution: compiled HLO instruction → source frame → component."""

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
