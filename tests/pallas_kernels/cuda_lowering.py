"""Lowering for CUDA on a CPU-only host, the same on jax 0.10.2 and 0.11.2: how the kernel tests
check the Triton lowering (what interpret mode cannot see) without a GPU.

jax 0.11's Pallas Triton lowering reads the target GPU (its compute capability) from the device
and, on a host without one, fails with "No supported GPU devices found, please specify an
abstract GPU device using AbstractDevice". So the lowering runs under an empty abstract mesh that
carries an `AbstractDevice` for the H200 of the project's GPU runs (an empty mesh shards nothing:
`sharding.context_mesh()` and `pallas_kernels.sharded` read it as no mesh). jax 0.10.2 reads no
device there and lowers the same way with or without it.
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def lower_for_cuda(fn, *args) -> jax.stages.Lowered:
  """`jax.jit(fn)` traced on `args` and lowered for the CUDA platform, targeting an H200."""
  with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=H200)):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_calls(lowered: jax.stages.Lowered) -> int:
  """How many Triton kernels (Pallas calls lowered by the Triton backend) the program holds."""
  return lowered.as_text().count('custom_call @__gpu$xla.gpu.triton')
