"""Two `jax.distributed` processes on 127.0.0.1, cheaply (the default run; the full two-process
training run in test_train.py is marked slow).

Each process (one CPU device) joins through `launch.train.init_distributed`, builds the data-2 mesh
the launcher builds, makes its own rows a shard of one global batch with `launch.train.to_global`,
and runs one jitted loss-and-gradient step with a replicated weight. Both must print the same loss
and gradient, equal to a float64 restatement over the union of both processes' rows.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS, D, O = 3, 8, 5

WORKER = textwrap.dedent(f"""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dsv41_jax import sharding
    from launch.train import init_distributed, replicate, to_global

    addr, pid = sys.argv[1], int(sys.argv[2])
    init_distributed(addr, 2, pid)
    mesh = sharding.make_mesh({{"data": -1, "fsdp": 1, "expert": 1, "engram": 1, "tensor": 1}})
    x = np.random.default_rng(pid).normal(size=({ROWS}, {D})).astype(np.float32)
    w = np.random.default_rng(99).normal(size=({D}, {O})).astype(np.float32)
    batch = to_global({{"x": x}}, mesh)
    w = replicate(w, NamedSharding(mesh, P()))
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
    value, grad = jax.jit(jax.value_and_grad(loss))(w, batch["x"])
    out = dict(pid=pid, processes=jax.process_count(), devices=jax.device_count(),
               mesh=dict(mesh.shape), global_rows=batch["x"].shape[0], loss=float(value),
               grad=np.asarray(jax.device_get(grad)).tolist())
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_one_global_step():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  addr = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, addr, str(i)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  results = []
  for p in procs:
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-4000:]
    results.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))

  x = np.concatenate([np.random.default_rng(i).normal(size=(ROWS, D)).astype(np.float32)
                      for i in range(2)]).astype(np.float64)
  w = np.random.default_rng(99).normal(size=(D, O)).astype(np.float32).astype(np.float64)
  t = np.tanh(x @ w)
  want_loss = np.mean(t ** 2)
  want_grad = x.T @ (2 * t * (1 - t ** 2)) / t.size
  for i, r in enumerate(results):
    assert (r["pid"], r["processes"], r["devices"], r["global_rows"]) == (i, 2, 2, 2 * ROWS)
    assert r["mesh"]["data"] == 2
    np.testing.assert_allclose(r["loss"], want_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r["grad"]), want_grad, rtol=1e-5, atol=1e-7)
  assert results[0]["loss"] == results[1]["loss"] and results[0]["grad"] == results[1]["grad"]
