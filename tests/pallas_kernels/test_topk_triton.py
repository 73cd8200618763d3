"""pallas_kernels/topk_triton.py (interpret mode; lowered for CUDA) against the radix select's
results (pallas_kernels.topk_select.radix_topk) and lax.top_k's sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers.indexer import select_topk
from pallas_kernels.topk_select import ordered_keys, radix_topk
from pallas_kernels.topk_triton import MAX_ENTRIES, ordered_int_keys, triton_topk, unsupported_reason
from tests.pallas_kernels.cuda_lowering import lower_for_cuda, triton_calls


@pytest.mark.parametrize("levels, n, k, digit_bits, early_exit",
                         [(None, 67, 9, 4, False), (2, 67, 9, 4, False), (7, 40, 64, 4, False),
                          (None, 67, 9, 1, False), (2, 67, 9, 2, False), (None, 67, 9, 1, True),
                          (2, 67, 9, 1, True), (7, 40, 64, 4, True)])
def test_equals_the_radix_select_and_lax_top_k_sets(levels, n, k, digit_bits, early_exit):
  # N and k off powers of two, k > N; ties straddling the k-th value; ±0.0; all-equal huge and
  # tiny rows; ±inf among the visible; neighbouring floats; no or fewer visible entries than k.
  rng = np.random.default_rng(n + k + (levels or 0))
  B, T = 2, 23
  s = rng.standard_normal((B, T, n)).astype(np.float32)
  if levels is not None:
    s = np.round(s * levels / 3) / levels
  s[0, :5] = 0.0
  s[0, :5, ::3] = -0.0
  s[1, 7] = 1e30
  s[1, 8, :] = -1e30
  s[1, 9, ::4], s[1, 9, 1::4] = np.inf, -np.inf
  # Neighbouring floats (keys one apart, in a shuffled order): the k-th needs every key bit.
  s[1, 10] = rng.permutation(np.arange(n, dtype=np.int32) + np.float32(1).view(np.int32)).view(
      np.float32)
  s[1, 11] = np.int32(0x3F800001).view(np.float32)   # equal values with an odd key tie at the
  s[1, 11, -3:] = 2.0                                 # k-th, below three larger last entries
  vis = rng.random((B, T, n)) < 0.6
  vis[0, 10] = False
  vis[0, 11] = False
  vis[0, 11, [3, n - 1]] = True
  vis[1, 9] = vis[1, 11] = True
  got = triton_topk(jnp.asarray(s), jnp.asarray(vis), k, digit_bits=digit_bits,
                    early_exit=early_exit)
  want = radix_topk(jnp.asarray(s), jnp.asarray(vis), k)
  assert got.shape == want.shape == (B, T, min(k, n)) and got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))   # slots too, not only sets
  ref, _ = select_topk(jnp.asarray(s), jnp.asarray(vis), k)
  np.testing.assert_array_equal(np.sort(np.asarray(got), -1), np.sort(np.asarray(ref), -1))
  assert (np.asarray(got)[0, 10] == -1).all()
  assert sorted(np.asarray(got)[0, 11][:2]) == [3, n - 1] and (np.asarray(got)[0, 11][2:] == -1).all()
  # Keys made in the kernel from the scores (visible None: score > −inf, the indexer's masked
  # scores): the same slots where the visible entries are the finite-or-+inf ones.
  masked = np.where(vis & (s > -np.inf), s, -np.inf)
  got = triton_topk(jnp.asarray(masked), None, k, digit_bits=digit_bits, early_exit=early_exit)
  want = radix_topk(jnp.asarray(masked), jnp.asarray(masked > -np.inf), k)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_keys_follow_the_total_order():
  x = np.array([-np.inf, -3.5, -1e-40, -0.0, 0.0, 1e-40, 2.0, np.inf], np.float32)
  keys = np.asarray(ordered_int_keys(jnp.asarray(x)))
  assert (np.diff(keys.astype(np.int64)) > 0).all() and keys.min() > np.iinfo(np.int32).min
  # Made in int32 alone (as in the kernel): the radix select's uint32 keys with the top bit
  # flipped, on random bit patterns (every sign, zero, subnormal, inf and NaN class).
  bits = np.random.default_rng(0).integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
  x = jnp.asarray(bits.view(np.float32))
  want = (np.asarray(ordered_keys(x)) ^ np.uint32(0x80000000)).view(np.int32)
  np.testing.assert_array_equal(np.asarray(ordered_int_keys(x)), want)


def test_wide_rows_are_refused_and_it_lowers_for_cuda():
  wide = jax.ShapeDtypeStruct((1, 2, MAX_ENTRIES + 1), jnp.float32)
  assert "exceed" in unsupported_reason(wide, wide, 8)
  with pytest.raises(ValueError, match="Triton top-k: .*entries per row"):
    triton_topk(jnp.zeros(wide.shape), jnp.ones(wide.shape, bool), 8)
  with pytest.raises(ValueError, match="digit_bits must be 1, 2 or 4"):
    triton_topk(jnp.zeros((1, 2, 8)), None, 4, digit_bits=3)
  # s3's indexer shape: 4 x 4,096 query rows over 4,096 entries, top-256, one Triton program.
  s = jax.ShapeDtypeStruct((4, 4096, 4096), jnp.float32)
  v = jax.ShapeDtypeStruct((4, 4096, 4096), jnp.bool_)
  lowered = lower_for_cuda(lambda a, b: triton_topk(a, b, 256, interpret=False), s, v)
  assert triton_calls(lowered) == 1
  for bits, early in ((1, False), (4, False), (1, True)):   # the scores read in the kernel
    lowered = lower_for_cuda(lambda a: triton_topk(a, None, 256, interpret=False,
                                                   digit_bits=bits, early_exit=early), s)
    assert triton_calls(lowered) == 1


def test_layer_remat_keeps_the_selection_instead_of_selecting_again():
  # Under the model's remat policy the named selection is saved: the gradient's program holds the
  # Triton select once (the forward's), as for the radix select (a bare pallas_call was staged
  # into the recomputed forward, so the indexer scored and selected twice per layer).
  from dsv41_jax.model import remat_policy
  rng = np.random.default_rng(3)
  s = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
  z = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
  vis = s > -1.0

  def loss(z, select):
    idx = select(jax.lax.stop_gradient(z) + s, vis, 4)
    return jnp.sum(jnp.sin(jnp.take_along_axis(z, jnp.maximum(idx, 0), axis=-1)))

  for select in (triton_topk, radix_topk):
    f = jax.checkpoint(lambda z, select=select: loss(z, select), policy=remat_policy)
    text = str(jax.make_jaxpr(jax.grad(f))(z))
    assert text.count("pallas_call[") == (1 if select is triton_topk else 0), select
    np.testing.assert_array_equal(np.asarray(jax.grad(f)(z)),
                                  np.asarray(jax.grad(lambda z: loss(z, radix_topk))(z)))
