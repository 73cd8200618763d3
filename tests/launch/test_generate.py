"""`launch.generate` / `launch.score`: restore from a work directory, score, sample, bad input.

The work directory is written here the way `launch.train` lays it out (`config.json` of the micro
config, `checkpoints/<step>/state` holding params, an optimizer state, MoE biases and the step),
so no training compile is needed; the optimizer state must be skipped by the restore.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP = 3


def _micro(cache_dir):
  from configs import tiny
  cfg = tiny.get_config("micro")
  cfg.data.cache_dir = cache_dir
  return cfg


def write_workdir(workdir, cfg, seed=0, drop=None):
  import orbax.checkpoint as ocp
  from configs.common import model_config
  from dsv41_jax import model as M
  mcfg = model_config(cfg)
  params = nnx.as_pure(nnx.split(M.init_model(mcfg, seed))[1])
  if drop is not None:  # a checkpoint of another layout: one parameter missing
    params = {k: v for k, v in params.items() if k != drop}
  bias = jax.random.normal(jax.random.key(seed), (mcfg.num_hidden_layers, 2, mcfg.n_routed_experts))
  state = {"params": params, "opt_state": {"mu": jax.tree.map(jnp.zeros_like, params)},
           "moe_bias": bias, "step": np.int32(STEP)}
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(workdir, "checkpoints", str(STEP), "state"), state)
  ckpt.wait_until_finished()
  return params, bias


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  root = tmp_path_factory.mktemp("generate")
  cfg = _micro(str(root / "data_cache"))
  workdir = str(root / "run")
  params, bias = write_workdir(workdir, cfg)
  return {"root": root, "cfg": cfg, "workdir": workdir, "params": params, "bias": bias}


@pytest.fixture(scope="module")
def loaded(env):
  from launch.generate import load_model
  return load_model(env["workdir"])


def test_restores_params_and_biases_without_the_optimizer(env, loaded):
  assert loaded.step == STEP
  got = jax.tree.leaves(nnx.as_pure(nnx.split(loaded.model)[1]))
  want = jax.tree.leaves(env["params"])
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(loaded.moe_bias), np.asarray(env["bias"]))


def test_score_matches_a_direct_cross_entropy(loaded):
  from dsv41_jax import inputs
  from launch import evaluation
  from launch.score import score
  text = "The river ran past the mill and under the old stone bridge."
  got = score(loaded, [text])
  ids = np.asarray(loaded.tokenizer.encode(text), np.int32)[None]
  T = ids.shape[1]
  batch = dict(tokens=jnp.asarray(ids), positions=jnp.arange(T)[None],
               segment_ids=jnp.ones((1, T), jnp.int32),
               engram_ids={k: jnp.asarray(v) for k, v in inputs.engram_ids(
                   loaded.model.cfg, ids, np.ones_like(ids), None, loaded.compression_map).items()})
  # jitted: one compile instead of the whole model dispatched op by op
  forward = nnx.jit(lambda model, b, bias: model(b, bias)[0])
  logits = np.asarray(forward(loaded.model, batch, loaded.moe_bias), np.float64)[0, :-1]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nats = -logp[np.arange(T - 1), ids[0, 1:]].sum()
  n_bytes = evaluation.token_byte_lengths(loaded.tokenizer, loaded.model.cfg.vocab_size)[ids[0, 1:]].sum()
  assert got["tokens"] == T - 1
  np.testing.assert_allclose(got["loss"], nats / (T - 1), rtol=1e-5)
  np.testing.assert_allclose(got["bits_per_byte"], nats / math.log(2) / n_bytes, rtol=1e-5)


def test_bad_work_directories(env, tmp_path, monkeypatch):
  from launch.generate import LoadError, load_model
  with pytest.raises(LoadError, match="holds no checkpoint"):
    load_model(str(tmp_path))
  with pytest.raises(LoadError, match="no checkpoint of step 7"):
    load_model(env["workdir"], step=7)
  other = dict(env["cfg"].model)
  other["hidden_size"] = 48
  with pytest.raises(LoadError, match=r"another model .*hidden_size"):
    load_model(env["workdir"], expected_model=other)
  # config.json of another model beside this checkpoint: the restore names the mismatch.
  swapped = str(tmp_path / "swapped")
  os.makedirs(swapped)
  os.symlink(os.path.join(env["workdir"], "checkpoints"), os.path.join(swapped, "checkpoints"))
  cfg = env["cfg"].to_dict()
  cfg["model"]["hidden_size"] = 48
  with open(os.path.join(swapped, "config.json"), "w") as f:
    json.dump(cfg, f)
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  with pytest.raises(LoadError, match=r"not a checkpoint of the model in its config.json "
                                      r"\(\['params'\]\S* is \(.*\) there, \(.*\) here\)"):
    load_model(swapped)
  # The mismatch is found before any array is read: no orbax read left pending, whose coroutines
  # would report "Exception ignored in <coroutine ...>" whenever they are collected.
  gc.collect()
  assert not unraisable, [f"{u.err_msg}: {u.object!r}" for u in unraisable]
  monkeypatch.undo()
  lacking = str(tmp_path / "lacking")
  write_workdir(lacking, env["cfg"], drop="head")
  with pytest.raises(LoadError, match=r"not a checkpoint of .*\(1 arrays missing, e.g. \['params'\]\['head'\]\)"):
    load_model(lacking)


def test_bad_prompts(loaded):
  from launch.generate import LoadError, encode_prompt
  with pytest.raises(LoadError, match="empty"):
    encode_prompt(loaded, "  ")
  with pytest.raises(LoadError, match=r"the limit is 31"):
    encode_prompt(loaded, "word " * 200)


def _cli(env, module, *args):
  e = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=e,
                        capture_output=True, text=True, timeout=600)


def test_command_line_errors(env, tmp_path):
  p = _cli(env, "launch.generate", f"--workdir={tmp_path}", "--prompt=hello")
  assert p.returncode == 2 and p.stderr.strip().splitlines() == [
      f"error: {tmp_path} holds no checkpoint (expected {tmp_path}/config.json and "
      f"{tmp_path}/checkpoints/<step>/ written by launch.train)"]
  p = _cli(env, "launch.generate", f"--workdir={env['workdir']}", "--prompt=")
  assert p.returncode == 2 and p.stderr.strip() == "error: the prompt is empty"
  p = _cli(env, "launch.score", f"--workdir={env['workdir']}", f"--data={tmp_path}/none.jsonl")
  assert p.returncode == 2 and p.stderr.strip().startswith(f"error: cannot read --data {tmp_path}")


@pytest.mark.slow  # two programs compile the model (≈ 2 min on the shared 2-core box)
def test_command_lines(env, tmp_path):
  data = tmp_path / "texts.jsonl"
  data.write_text('{"text": "The river ran past the mill."}\n{"text": "A second line of text."}\n')
  p = _cli(env, "launch.score", f"--workdir={env['workdir']}", f"--data={data}")
  assert p.returncode == 0, p.stderr[-2000:]
  result = json.loads(p.stdout.strip().splitlines()[-1])
  assert result["texts"] == 2 and math.isfinite(result["bits_per_byte"])
  p = _cli(env, "launch.generate", f"--workdir={env['workdir']}", "--prompt=The river",
           "--max_new_tokens=4", "--temperature=0")
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.startswith("The river")
