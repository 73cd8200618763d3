"""launch.aot and launch.memory_plan: mesh parsing, the analytic per-device plan against jax's own
shard shapes and the real optimizer state, the CLI (errors, analytic fallback), and (slow) the
compiled plan."""

import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from configs.common import model_config
from dsv41_jax import model as model_lib, sharding
from launch import aot, memory_plan
from launch.step import engram_sub_tables
from optim.chain import build_optimizer, opt_state_shardings
from optim.config import optim_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_mesh_and_errors():
  assert memory_plan.parse_mesh("data:8,expert:4") == {"data": 8, "expert": 4}
  assert memory_plan.resolve_mesh({"data": -1, "expert": 4}, 32)["data"] == 8
  for bad, words in [("dta:8", "unknown mesh axis 'dta'"), ("data=8", "not AXIS:SIZE"),
                     ("data:x", "not an integer"), ("data:0", "positive"),
                     ("data:-1,fsdp:-1", "at most one"), ("data:2,data:2", "twice"),
                     ("", "empty mesh")]:
    with pytest.raises(memory_plan.PlanError, match=words):
      memory_plan.parse_mesh(bad)
  with pytest.raises(memory_plan.PlanError, match="has 12 positions but there are 8 devices"):
    memory_plan.resolve_mesh({"data": 3, "expert": 4}, 8)
  with pytest.raises(memory_plan.PlanError, match="does not divide the 8 devices"):
    memory_plan.resolve_mesh({"data": -1, "expert": 3}, 8)
  with pytest.raises(memory_plan.PlanError, match="unknown mesh axes"):
    memory_plan.parse_rules("engram_rows=engram+rows")
  assert memory_plan.parse_rules("engram_rows=engram+fsdp")["engram_rows"] == ("engram", "fsdp")


def test_global_batch():
  assert memory_plan.global_batch_for(None, 8, 32)[0] == 32
  assert "rounded up" in memory_plan.global_batch_for(None, 8, 32)[1]
  assert memory_plan.global_batch_for(64, 8, 32) == (64, "")
  with pytest.raises(memory_plan.PlanError, match="multiple of 32"):
    memory_plan.global_batch_for(48, 8, 32)


@pytest.mark.parametrize("sizes", [{"data": 2, "expert": 4}, {"fsdp": 2, "tensor": 2, "engram": 2}])
def test_analytic_bytes_match_jax_shard_shapes_and_the_real_optimizer_state(sizes):
  """Parameters: Σ of `NamedSharding.shard_shape` over the real shardings; optimizer: Σ over the
  leaves of `tx.init` (abstract) with `opt_state_shardings`, counters included (a few bytes)."""
  cfg = tiny.get_config()
  mcfg = model_config(cfg)
  full = memory_plan.resolve_mesh(sizes, math.prod(sizes.values()))
  mesh = sharding.make_mesh(full, jax.devices()[:math.prod(sizes.values())])
  plan = memory_plan.analytic_plan(mcfg, full, global_batch=8, seq_len=cfg.data.seq_len)

  abs_model = model_lib.abstract_model(mcfg)
  abs_state = nnx.state(abs_model, nnx.Param)
  shard = nnx.as_pure(sharding.state_shardings(abs_state, mesh))
  params = nnx.as_pure(abs_state)

  def local_bytes(tree, shardings):
    leaves, ss = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    return sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize for x, s in zip(leaves, ss))

  assert plan["param_bytes"] == local_bytes(params, shard)
  assert plan["total_params"] == model_lib.param_count(params)
  tx = build_optimizer(optim_config(dict(cfg.optim)), params,
                       sub_tables=engram_sub_tables(abs_model))
  opt = jax.eval_shape(tx.init, params)
  got = local_bytes(opt, opt_state_shardings(tx, params, shard))
  n_scalars = sum(1 for x in jax.tree.leaves(opt) if x.ndim == 0)
  assert 0 <= got - plan["opt_bytes"] <= 8 * n_scalars
  assert plan["rows_per_device"] == 8 // math.prod(
      full[a] for a in ("data", "fsdp", "expert", "engram"))
  # every axis that splits something is reported with what it splits
  assert set(plan["axes_use"]) == {a for a, s in full.items() if s > 1}
  if "engram" in sizes:
    assert "engram/table" in plan["axes_use"]["engram"]


def test_activation_estimate_terms():
  """The estimate's terms follow its formula: logits and carries scale with rows, the masked
  global branch grows quadratically in T while "gather" grows linearly; bfloat16 streams halve
  the carries."""
  mcfg = model_config(tiny.get_config())
  one = memory_plan.activation_bytes(mcfg, 1, 128, {"data": 1})
  two = memory_plan.activation_bytes(mcfg, 2, 128, {"data": 1})
  for k in ("carries", "layer_work", "logits", "total"):
    assert two[k] == pytest.approx(2 * one[k])
  assert one["logits"] == 3 * 128 * mcfg.vocab_size * 4
  layers = len(model_lib.build_layer_plan(mcfg).layers)
  assert one["carries"] == (layers + 1) * 128 * mcfg.hc_mult * mcfg.hidden_size * 4
  bf16 = memory_plan.activation_bytes(mcfg.replace(hc_stream_dtype="bfloat16"), 1, 128, {"data": 1})
  assert bf16["carries"] == one["carries"] / 2 and bf16["layer_work"] == one["layer_work"]
  tp = memory_plan.activation_bytes(mcfg, 1, 128, {"tensor": 2})
  assert tp["logits"] == one["logits"] / 2
  masked = [memory_plan.activation_bytes(mcfg, 1, T, {})["layer_work"] for T in (512, 1024, 2048)]
  gather = mcfg.replace(global_attn_impl="gather")
  gathered = [memory_plan.activation_bytes(gather, 1, T, {})["layer_work"] for T in (512, 1024, 2048)]
  assert masked[2] - masked[1] > 1.9 * (masked[1] - masked[0])
  assert gathered[2] - gathered[1] == pytest.approx(2 * (gathered[1] - gathered[0]), rel=0.05)


def _cli(*args):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "launch.aot", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_cli_errors_and_analytic_fallback():
  r = _cli("--config=configs/tiny.py", "--mesh=data:8,experts:4")
  assert r.returncode == 2 and "unknown mesh axis 'experts'" in r.stderr, r.stderr[-2000:]
  r = _cli("--config=configs/tiny.py", "--mesh=data:8,expert:4", "--max_compile_params=1e5")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "ANALYTIC" in r.stdout and "analytic plan only" in r.stdout
  assert "global batch 32" in r.stdout and "rounded up" in r.stdout
  assert "estimate for cpu" in r.stdout               # the machine it runs on, by default
  r = _cli("--config=configs/small.py:s3", "--mesh=data:1", "--batch=32", "--seq=4096",
           "--config.train.grad_accum_steps=8", "--analytic", "--backend=gpu")
  assert r.returncode == 0 and "estimate for gpu" in r.stdout, r.stderr[-2000:]
  gib = float(re.search(r"total\s+([\d.]+) GiB", r.stdout).group(1))
  assert abs(gib - 41.8) < 0.1                          # RESULTS.md, session 51: 43.7 measured
  r = _cli("--config=configs/tiny.py", "--mesh=data:1", "--analytic", "--backend=xpu")
  assert r.returncode != 0 and "--backend" in r.stderr
  r = _cli("--config=configs/tiny.py", "--mesh=data:8,expert:4", "--analytic", "--hlo_out=/tmp/x")
  assert r.returncode == 2 and "--hlo_out needs the compiled plan" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_compiled_plan_arguments_are_params_optimizer_and_batch(tmp_path):
  """XLA's per-device argument bytes = analytic parameters + optimizer state + the batch shard;
  `hlo_out` gets the compiled program's text."""
  cfg = tiny.get_config()
  sizes = memory_plan.resolve_mesh({"data": 2, "expert": 2}, 4)
  gb = 4
  cfg.data.batch_size = gb
  out = aot.compiled_plan(cfg, sizes, gb, hlo_out=str(tmp_path / "step.hlo.txt"))
  assert "\nENTRY " in (tmp_path / "step.hlo.txt").read_text()
  plan = memory_plan.analytic_plan(model_config(cfg), sizes, gb, cfg.data.seq_len)
  batch = aot.abstract_batch(cfg, model_config(cfg), gb)
  batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) / 4
  m = out["memory"]
  expected = plan["param_bytes"] + plan["opt_bytes"] + batch_bytes
  assert m["argument"] == pytest.approx(expected, rel=0.01, abs=4096)
  assert m["alias"] > 0.99 * (plan["param_bytes"] + plan["opt_bytes"])
  assert m["temp"] > plan["param_bytes"]  # the gradients at least


def test_small_configs_keep_flash_layout_and_plan():
  """`configs/small.layout` at Flash's depth reproduces the released layer roles; every size builds
  a valid ModelConfig, the s-ladder growing in width, depth and experts; s1 plans on an 8-device
  mesh."""
  from configs import flash, small
  ref = model_config(flash.get_config())
  got = small.layout(ref.num_hidden_layers)
  for k, v in got.items():
    assert getattr(ref, k) == v, k
  last = (0, 0, 0)
  for name in sorted(small.SIZES):
    cfg = small.get_config(name)
    mcfg = model_config(cfg)
    assert mcfg.seq_len == cfg.data.seq_len and mcfg.vision is not None
    # bfloat16 streams and compute-dtype expert products from s3 up (each by a 4-seed s1 A/B)
    narrow = name in ("s3", "s4", "m3")
    assert (mcfg.hc_stream_dtype, mcfg.moe_product_dtype) == (
        ("bfloat16", "compute") if narrow else ("float32", "float32")), name
    if name.startswith("s"):   # m3 is a one-GPU 3B-class config beside the ladder
      now = (mcfg.hidden_size, mcfg.num_hidden_layers, mcfg.n_routed_experts)
      assert all(a > b for a, b in zip(now, last)), name
      last = now
  sizes = memory_plan.resolve_mesh({"data": 2, "expert": 4}, 8)
  plan = memory_plan.analytic_plan(model_config(small.get_config("s1")), sizes, 8, 256)
  assert plan["rows_per_device"] == 1 and plan["opt_bytes"] >= plan["param_bytes"]
