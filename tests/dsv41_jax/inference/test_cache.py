"""dsv41_jax/inference/cache.py: the stored KV formats decode to the model's fake quantizers bit
for bit, and the cache arrays hold the bytes per token the ledger counts (docs/design.md §5.7, §9,
§10)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import cache_layout, quant, testing
from dsv41_jax.config import ModelConfig
from dsv41_jax.inference import cache as C


@pytest.mark.parametrize("encode,decode_fn,fq", [
    (C.encode_fp4_main_kv, C.decode_fp4_main_kv, quant.fp4_main_kv),
    (C.encode_mxfp4, C.decode_mxfp4, quant.mxfp4),
    (C.encode_fp8_swa, C.decode_fp8_swa, quant.fp8_swa)])
def test_stored_codes_decode_to_the_fake_quantizer_bit_for_bit(encode, decode_fn, fq):
  rng = np.random.default_rng(1)
  # Blocks spanning many binades, exact ties of the E2M1 grid, zeros and a negative zero block.
  x = rng.standard_normal((3, 5, 64)) * np.exp2(rng.integers(-12, 12, (3, 5, 1)))
  x[0, 0, :16] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 0.5
  x[0, 1, :32] = 0.0
  x[0, 2, :32] = -0.0
  x = jnp.asarray(x, jnp.float32)
  for run in (lambda f, *a: f(*a), lambda f, *a: jax.jit(f)(*a)):
    codes = run(encode, x)
    got = np.asarray(run(decode_fn, *codes))
    want = np.asarray(fq(x))
    np.testing.assert_array_equal(got.view(np.uint32) & 0x7FFFFFFF, want.view(np.uint32) & 0x7FFFFFFF)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_cache_bytes_per_token_from_the_arrays_equal_the_ledger(which):
  c = testing.inference_micro_config() if which == "tiny" else ModelConfig()
  max_len = 64
  cache = C.init_cache(c, 2, max_len)
  layout = cache_layout.global_kv_layout(c)
  assert C.global_bytes_per_token(cache, max_len) == layout.bytes_per_token
  assert C.swa_bytes_per_sequence(cache) == cache_layout.swa_kv_bytes_per_sequence(c)
  if which == "flash":
    assert layout.bytes_per_token == 890
