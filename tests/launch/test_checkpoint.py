"""launch/checkpoint.py: a failing save (a full disk, simulated) fails cleanly (issue 11 item 2).

The write of the data-iterator state raises ENOSPC mid-save, after orbax has made the step's
temporary directory: `SaveError` names the step and the last good checkpoint, the temporary
directory is gone, and the previous checkpoint restores bit for bit.
"""

import errno
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch import checkpoint as ckpt_lib


def _iterator():
  return iter(grain.MapDataset.range(100).to_iter_dataset())


def test_full_disk_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), keep=3)
  state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "step": jnp.int32(1)}
  it = _iterator()
  next(it)
  ckpt.save(1, state, it)
  ckpt.wait()
  good = sorted(os.listdir(ckpt.directory))

  partial = []

  def full_disk(self, directory, item=None, args=None):
    partial.append(str(directory))  # orbax's temporary directory of step 2, already on disk
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(grain.checkpoint.CheckpointHandler, "save", full_disk)
  with pytest.raises(ckpt_lib.SaveError) as e:
    ckpt.save(2, {"w": state["w"] + 1, "step": jnp.int32(2)}, it)
    ckpt.close()  # a background failure surfaces here at the latest
  msg = str(e.value)
  assert "step 2" in msg and "No space left on device" in msg and "(step 1) is intact" in msg
  assert partial and "orbax-checkpoint-tmp" in partial[0]
  assert not any(os.path.exists(p) for p in partial)
  assert sorted(os.listdir(ckpt.directory)) == good  # no *.orbax-checkpoint-tmp* left behind
  monkeypatch.undo()
  again = ckpt_lib.Checkpointer(str(tmp_path), keep=3)
  step, restored = again.restore_latest(ckpt_lib.abstract_like(state), _iterator())
  again.close()
  assert step == 1
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
