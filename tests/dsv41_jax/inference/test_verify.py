"""`dsv41_jax/inference/verify.py`: a verified span equals Q decode steps; rollback equals decoding
only the kept rows.

The micro model of test_decode.py (every CSA2 mode, Engram, the candidate pool, window 8), caches
of the forward pass's own values, so the only differences are float rounding: the span groups the
same float32 operations over Q rows instead of one (the tolerance of test_decode.py, 2e-5 absolute
on logits, applies). The prompt of 11 tokens leaves an m = 2 group pending and the window wrapped;
the span of 5 completes and starts groups of both ratios, so the rollback must restore entries,
ring slots and the pending group.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import model as M, testing
from dsv41_jax.inference import Decoder, cache as C, decode, verify

T, N, Q = 32, 11, 5
ATOL = 2e-5


@pytest.fixture(scope="module")
def setup():
  cfg = testing.inference_micro_config()
  model = M.init_model(cfg, 0)
  bias = jax.random.normal(jax.random.key(3), (cfg.num_hidden_layers, 2, cfg.n_routed_experts)) * 0.1
  dec = Decoder(model, bias, stored_formats=False)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
  graphdef, params = nnx.split(model)
  step = jax.jit(lambda p, c, tok, t, ids: decode.decode_step(nnx.merge(graphdef, p), c, tok, t,
                                                              ids, bias))
  span = jax.jit(lambda p, c, tok, t, ids: verify.verify_span(nnx.merge(graphdef, p), c, tok, t,
                                                              ids, bias))
  cache = C.init_cache(cfg, 1, T, stored_formats=False)
  out = dec._prefill(dec.params, cache, jnp.asarray(tokens[:, :N]), dec.engram_ids(tokens[:, :N]),
                     dec.moe_bias, "full")
  back = jax.jit(lambda o, n, tr, k: verify.rollback(cfg, o, n, tr, N, k))
  return cfg, dec, tokens, params, step, span, out["cache"], back


def _ids(dec, tokens, lo, hi):
  """Engram rows of tokens lo … hi−1 (each from its own n-gram history)."""
  ids = dec.engram_ids(tokens[:, :hi])
  return {l: v[:, lo:hi] for l, v in ids.items()}


def _sequential(dec, tokens, params, step, cache, n):
  logits = []
  for t in range(N, N + n):
    lg, cache = step(params, cache, jnp.asarray(tokens[:, t]), jnp.int32(t), _ids(dec, tokens, t, t + 1))
    logits.append(np.asarray(lg)[0])
  return np.stack(logits) if logits else np.zeros((0,)), cache


def test_span_logits_equal_sequential_decode_steps(setup):
  cfg, dec, tokens, params, step, span, cache, back = setup
  want, _ = _sequential(dec, tokens, params, step, cache, Q)
  got, hidden, _, _ = span(params, cache, jnp.asarray(tokens[:, N:N + Q]), jnp.int32(N),
                           _ids(dec, tokens, N, N + Q))
  np.testing.assert_allclose(np.asarray(got)[0], want, rtol=0, atol=ATOL)
  assert hidden.shape == (1, Q, cfg.hidden_size)


@pytest.mark.parametrize("n_keep", [1, 3, Q])
def test_rollback_equals_decoding_only_the_kept_rows(setup, n_keep):
  """After the span and its rollback to n_keep rows, the caches equal those of n_keep decode steps
  and the next decode steps give the same logits."""
  cfg, dec, tokens, params, step, span, cache, back = setup
  _, want_cache = _sequential(dec, tokens, params, step, cache, n_keep)
  _, _, new, trail = span(params, cache, jnp.asarray(tokens[:, N:N + Q]), jnp.int32(N),
                          _ids(dec, tokens, N, N + Q))
  got_cache = back(cache, new, trail, jnp.int32(n_keep))
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0,
                               atol=1e-5)
  t = N + n_keep
  a, _ = step(params, got_cache, jnp.asarray(tokens[:, t]), jnp.int32(t), _ids(dec, tokens, t, t + 1))
  b, _ = step(params, want_cache, jnp.asarray(tokens[:, t]), jnp.int32(t), _ids(dec, tokens, t, t + 1))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL)
