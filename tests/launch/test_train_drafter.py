"""`launch.train_drafter`: the drafter stage on a frozen backbone, exact resume, bad input, and
`load_drafter` / `launch.generate --speculative`'s fallback.

The backbone work directory is written the way `launch.train` lays it out (test_generate.py's
`write_workdir`: the micro config, random parameters), so no backbone training compile is needed.
One drafter step program is compiled and shared by every run here (`_make_step` is cached).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from launch import drafter as D, train_drafter as TD
from launch.generate import LoadError, load_model, speculative_decoder
from tests.launch.test_generate import _micro, write_workdir


def _drafter_cfg(steps=4):
  from configs.dspark import get_config
  cfg = get_config()
  cfg.drafter.update(num_heads=2, sliding_window=16, draft_len=3, markov_rank=4,
                     confidence_width=8)
  cfg.train.update(steps=steps, batch_size=2, log_every=1, checkpoint_every=100, warmup_steps=1)
  return cfg


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  root = tmp_path_factory.mktemp("drafter")
  cfg = _micro(str(root / "data_cache"))
  backbone = str(root / "backbone")
  params, bias = write_workdir(backbone, cfg)
  straight = TD.run(_drafter_cfg(), backbone, str(root / "straight"))
  return {"root": root, "backbone": backbone, "params": params, "straight": straight}


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_backbone_leaves_are_bit_identical_after_drafter_training(env):
  """The parameters the stage read, and the checkpoint on disk, equal the backbone written."""
  want = _leaves(env["params"])
  assert env["straight"]["end_step"] == 4
  got = _leaves(nnx.as_pure(env["straight"]["backbone_params"]))
  disk = _leaves(nnx.as_pure(nnx.split(load_model(env["backbone"]).model)[1]))
  assert len(got) == len(want) == len(disk)
  for a, b, c in zip(got, want, disk):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c, b)
  assert np.isfinite(float(env["straight"]["figures"]["loss"]))


def test_interrupted_and_resumed_equals_straight_bit_for_bit(env):
  wd = str(env["root"] / "resumed")
  first = TD.run(_drafter_cfg(), env["backbone"], wd, stop_at=2)
  assert first["end_step"] == 2
  second = TD.run(_drafter_cfg(), env["backbone"], wd)
  assert (second["start_step"], second["end_step"]) == (2, 4)
  for a, b in zip(_leaves(second["drafter_params"]), _leaves(env["straight"]["drafter_params"])):
    np.testing.assert_array_equal(a, b)
  # The trained drafter loads for the backbone it was trained on.
  d = D.load_drafter(wd, load_model(env["backbone"]))
  for a, b in zip(_leaves(nnx.as_pure(nnx.split(d)[1])), _leaves(second["drafter_params"])):
    np.testing.assert_array_equal(a, b)


def test_a_drafter_config_of_another_width_names_the_mismatch(env):
  cfg = _drafter_cfg()
  cfg.drafter.hidden_size = 64
  with pytest.raises(D.DrafterStageError, match=r"drafter.hidden_size=64 .*backbone's hidden_size 32"):
    TD.run(cfg, env["backbone"], str(env["root"] / "wide"))


def test_a_drafter_of_another_backbone_is_refused(env, tmp_path):
  """A drafter directory trained for vocabulary 512, against a backbone of another vocabulary:
  resuming names the backbone field, loading for generation names the vocabulary."""
  wd = str(env["root"] / "straight")
  other = str(tmp_path / "other")
  cfg = _micro(str(env["root"] / "data_cache"))
  cfg.model.vocab_size = 640
  cfg.model.engram_compressed_vocab_size = 640
  write_workdir(other, cfg)
  with pytest.raises(D.DrafterStageError, match="another backbone .*vocab_size: stored 512 vs now 6"):
    TD.run(_drafter_cfg(), other, wd)
  with pytest.raises(D.DrafterStageError, match="for vocab_size 512; this backbone has vocab_size 640"):
    D.load_drafter(wd, load_model(other))


def test_missing_drafter_falls_back_with_one_warning_or_errors_when_required(env, tmp_path, capsys):
  loaded = load_model(env["backbone"])
  assert speculative_decoder(loaded, str(tmp_path / "none"), False, None) == (None, None)
  err = capsys.readouterr().err
  assert err.count("warning:") == 1 and "decoding without speculation" in err
  with pytest.raises(LoadError, match="holds no drafter checkpoint"):
    speculative_decoder(loaded, str(tmp_path / "none"), True, None)
