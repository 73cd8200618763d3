"""`launch.unfilled_buffers`: scan stacks and conditional residual slots lowered for the GPU as
AllocateBuffer (no zero fill), the same values on the CPU, undone by `uninstall`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import zero_fills
from launch import unfilled_buffers
from tests.pallas_kernels.cuda_lowering import lower_for_cuda


@pytest.fixture
def installed():
  assert unfilled_buffers.install()
  yield
  unfilled_buffers.uninstall()


def _loss(w, x, kinds):
  """A rematerialised scan (its saved inputs are a stack) and a scan over a two-branch switch
  whose branches save different residuals (the CSA2 kind switch's shape)."""
  def layer(c, wi):
    return jnp.tanh(c @ wi), None
  c, _ = jax.lax.scan(jax.checkpoint(layer), x, w)

  def mixed(c, k):
    return jax.lax.switch(k, [lambda c: jnp.sin(c) * c, lambda c: c + 1.0], c), None
  c, _ = jax.lax.scan(mixed, c, kinds)
  return jnp.sum(c * c)


def _args():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(6, 32, 32)) / 6, jnp.float32)
  x = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
  return w, x, jnp.asarray([0, 1, 0, 1], jnp.int32)


def _zero_fill_bytes(text: str) -> int:
  """Bytes written by broadcasts of a scalar constant (jax's zero fills) in a StableHLO text."""
  consts = set(re.findall(r"(%\S+) = stablehlo.constant dense<0[^>]*> : tensor<[a-z0-9]+>", text))
  total = 0
  for operand, shape in re.findall(
      r"stablehlo.broadcast_in_dim (%[^,\s]+), dims = \[\] : \(tensor<[a-z0-9]+>\) -> "
      r"tensor<([0-9x]+)x[a-z0-9]+>", text):
    if operand in consts:
      total += int(np.prod([int(d) for d in shape.split("x")]))
  return total


def test_gpu_lowering_allocates_instead_of_filling(installed):
  grad = jax.grad(_loss)
  text_on = lower_for_cuda(grad, *_args()).as_text()
  unfilled_buffers.uninstall()
  text_off = lower_for_cuda(grad, *_args()).as_text()
  assert "AllocateBuffer" not in text_off
  # The stacks: the checkpointed scan's saved carries [6, 8, 32], its backward's weight gradient
  # [6, 32, 32]; the switch's residual slot the identity branch leaves empty.
  allocated = zero_fills.allocations(text_on)
  assert "6x32x32xf32" in allocated and "6x8x32xf32" in allocated, allocated
  assert _zero_fill_bytes(text_on) < _zero_fill_bytes(text_off)
  # One kind at a time (benchmarks/zero_fills.py): the switch slots alone leave the stacks filled.
  assert unfilled_buffers.install(stacks=False)
  slots_only = zero_fills.allocations(lower_for_cuda(grad, *_args()).as_text())
  assert slots_only and "6x32x32xf32" not in slots_only and "6x8x32xf32" not in slots_only
  unfilled_buffers.uninstall()
  assert unfilled_buffers.install()   # the fixture uninstalls


def test_values_are_unchanged_on_the_cpu():
  fn = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))
  ref = fn(*_args())
  assert unfilled_buffers.install() and unfilled_buffers.install()   # idempotent
  try:
    got = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))(*_args())
  finally:
    unfilled_buffers.uninstall()
  assert not unfilled_buffers.installed()
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_train_step_is_built_with_it_when_configured_and_without_it_otherwise(monkeypatch):
  from configs import tiny
  from launch import setup
  calls = []
  monkeypatch.setattr(unfilled_buffers, "install", lambda: calls.append("install") or True)
  monkeypatch.setattr(unfilled_buffers, "uninstall", lambda: calls.append("uninstall"))
  for on in (True, False):
    cfg = tiny.get_config()
    cfg.train.unfilled_buffers = on
    run = setup.run_config(cfg, process_count=1)
    ts = setup.abstract_state(run, setup.build_mesh(setup.MeshConfig(data=1), jax.devices()[:1]))
    setup.train_step_jit(run, ts)
  assert calls == ["install", "uninstall"]


def test_sharded_values_are_unchanged_and_the_sharded_step_lowers(installed):
  """On a 2 × 4 CPU mesh: the toy's sharded values bit for bit those without the patch; the tiny train step on data 2 × tensor 2 × expert 2 lowers for CUDA with AllocateBuffers
  (`lax.empty` takes the stacks' shardings)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from configs import tiny
  from configs.common import MeshConfig
  from launch import aot, setup

  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  w, x, kinds = _args()
  w = jax.device_put(w, NamedSharding(mesh, P(None, None, "tensor")))
  x = jax.device_put(x, NamedSharding(mesh, P("data", None)))

  def sharded():
    with jax.set_mesh(mesh):
      return jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))(w, x, kinds)
  got = sharded()
  unfilled_buffers.uninstall()
  ref = sharded()
  assert unfilled_buffers.install()
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  step_mesh = setup.build_mesh(MeshConfig(data=2, tensor=2, expert=2), jax.devices()[:8])
  low = aot.lower_args(tiny.get_config(), step_mesh, 8)
  with jax.set_mesh(low.mesh):
    text = jax.jit(low.step, donate_argnums=(0,), out_shardings=low.out_shardings).trace(
        *low.args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("AllocateBuffer") > 100
