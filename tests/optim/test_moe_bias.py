"""MoE routing-bias update (optim/moe_bias.py): direction and size, per modality row."""

import jax.numpy as jnp
import numpy as np
import pytest

from optim.moe_bias import update_moe_bias


def test_direction_size_and_idle_rows():
  rng = np.random.default_rng(0)
  bias = rng.standard_normal((3, 2, 8)).astype(np.float32)
  load = rng.integers(0, 50, (3, 2, 8)).astype(np.float32)
  load[1, 1] = 0           # layer 1 saw no image tokens: its image row must not move
  load[2, 0, :] = 7        # perfectly balanced text row: no change
  new = np.asarray(update_moe_bias(jnp.asarray(bias), jnp.asarray(load), 0.001))
  for l in range(3):
    for m in range(2):
      row = load[l, m]
      for e in range(8):
        if row.sum() == 0:
          want = bias[l, m, e]
        elif row[e] > row.mean():
          want = bias[l, m, e] - 0.001     # overloaded expert: less likely to be picked
        elif row[e] < row.mean():
          want = bias[l, m, e] + 0.001
        else:
          want = bias[l, m, e]
        assert new[l, m, e] == pytest.approx(want, abs=1e-7), (l, m, e)
  np.testing.assert_array_equal(new[1, 1], bias[1, 1])
  np.testing.assert_array_equal(new[2, 0], bias[2, 0])


def test_shape_errors():
  with pytest.raises(ValueError, match="differ"):
    update_moe_bias(jnp.zeros((2, 8)), jnp.zeros((2, 4)), 0.001)
  with pytest.raises(ValueError, match="2 \\(text, image\\)"):
    update_moe_bias(jnp.zeros((3, 8)), jnp.ones((3, 8)), 0.001)
