"""benchmarks/hlo_traffic.py: bytes per kernel times executions per step, on CPU-compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import hlo_traffic


def _program(x_LxN, w_N):
  # A 5-trip loop whose body reads one row of x (a dynamic slice) and rewrites the [N] carry.
  def body(i, acc):
    return jnp.tanh(acc * x_LxN[i] + w_N)
  return jax.lax.fori_loop(0, 5, body, w_N)


def test_loop_kernels_count_their_trips_and_slices_count_what_they_read():
  L, N = 64, 4096
  text = jax.jit(_program).lower(jnp.ones((L, N)), jnp.ones(N)).compile().as_text()
  rows = hlo_traffic.traffic(text)
  loop = [r for r in rows if r[5] == 5 and r[0] == "fusion"]
  assert loop, rows
  # Each trip: the carry and w read, one row of x read (not all L rows), the carry written.
  gb = sum(r[4] for r in loop)
  assert np.isclose(gb, 5 * 4 * N * 4 / 1e9, rtol=0.05), gb
  assert gb < 5 * L * N * 4 / 1e9 / 4          # far below reading x whole every trip
  assert all(r[1].startswith("tests/benchmarks/test_hlo_traffic.py:") for r in loop)


def test_shapes_and_branch_shares():
  assert hlo_traffic.nbytes("(f32[2,3]{1,0}, bf16[4]{0}, pred[])") == 24 + 8 + 1
  text = """HloModule m

%a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %copy.1 = f32[4]{0} copy(%p)
}

%b (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %negate.1 = f32[4]{0} negate(%q)
}

ENTRY %main (i: s32[], x: f32[4]) -> f32[4] {
  %i = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  ROOT %cond.1 = f32[4]{0} conditional(%i, %x, %x), branch_computations={%a, %b}
}
"""
  runs = {r[3]: r[5] for r in hlo_traffic.traffic(text)}
  assert runs == {"copy.1": 0.5, "negate.1": 0.5}
  runs = {r[3]: r[5] for r in hlo_traffic.traffic(text, {"2": [0.25, 0.75]})}
  assert runs == {"copy.1": 0.25, "negate.1": 0.75}
