"""`dsv41_jax.inference` (decode.py and the Decoder): prefill + decode against the forward pass.

One micro model (`testing.tiny_config`: SWA, Full m = 2, Reuse, Engram in the encoder; Full m = 1
candidate source + three Reindex candidate consumers in the decoder; window 8, top-4 of the
entries). One token sequence of 32 is the reference: the forward pass's logits at position t are
what every prefill and decode path must give at t (all prompts are prefixes of it).

The exactness tests use caches holding the forward pass's own values (`stored_formats=False`),
so the only differences are float rounding. Tolerance: decode recomputes each value with the same
float32 operations grouped differently (one query instead of a block of rows, the window gathered
instead of block-local, T = 1 einsums): |Δlogit| ≲ 1e-6 per unit of logit across the 8 layers
(measured ≤ 2.2e-6 at |logit| ≤ 4 here). 2e-5 absolute is that bound with margin; a wrong key,
entry or top-k slot moves logits by ≥ 1e-3. With the stored formats (FP4 / FP8 codes) decode is the
forward pass with the QAT quantizers on, but a rounding-level difference can move a value across a
code boundary, so no float tolerance holds for it end to end: the codes are tested bit for bit
against the fake quantizers (test_cache.py), and the end-to-end divergence is measured
(benchmarks/inference.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import model as M, testing
from dsv41_jax.inference import Decoder, cache as C, decode

T = 32
ATOL = 2e-5


@pytest.fixture(scope="module")
def cfg():
  return testing.inference_micro_config()


@pytest.fixture(scope="module")
def setup(cfg):
  return testing.decode_reference(cfg, T)


def decode_from(dec, tokens, logits, cache, start):
  """Logits [T − start + 1, V]: the prefill's last row, then a decode step at every later position."""
  out = [np.asarray(logits)[0]]
  for t in range(start, T):
    logits, cache = dec.step(cache, tokens, t)
    out.append(np.asarray(logits)[0])
  return np.stack(out)


# --- prefill and decode against the forward pass -------------------------------------------------

def test_exact_path_equals_the_forward_pass_at_every_position(cfg, setup):
  """Full-depth prefill of 11 tokens (a partial m = 2 group pending, the window wrapped), then a
  decode step at each of positions 11 … 31: all 32 positions match the forward pass."""
  dec, tokens, ref = setup
  N = 11
  cache = C.init_cache(cfg, 1, T, stored_formats=False)
  out = dec._prefill(dec.params, cache, jnp.asarray(tokens[:, :N]), dec.engram_ids(tokens[:, :N]),
                     dec.moe_bias, "full")
  np.testing.assert_allclose(np.asarray(out["logits"])[0], ref[:N], rtol=0, atol=ATOL)
  got = decode_from(dec, tokens, out["logits"][:, -1], out["cache"], N)
  np.testing.assert_allclose(got, ref[N - 1:], rtol=0, atol=ATOL)


def test_ced_prefill_is_exact_when_the_prompt_fits_the_window(cfg, setup):
  dec, tokens, ref = setup
  N = cfg.sliding_window
  assert decode.replay_start(cfg, N) == 0
  logits, cache = dec.prefill(tokens[:, :N], T, depth="ced")
  got = decode_from(dec, tokens, logits, cache, N)
  np.testing.assert_allclose(got, ref[N - 1:], rtol=0, atol=ATOL)


def test_bounded_replay_diverges_then_decode_becomes_exact(cfg, setup):
  """N = 9 > W: the replay starts at s = 1, so the decoder's SWA keys of tokens s … N − 2 miss
  their earliest window keys. A wrong key of decoder layer j reaches layer j + 1's outputs up to
  W − 1 positions later, so after the L_dec decoder layers the logits are exact again from
  t = N − 1 + (L_dec − 1)(W − 1) on; before that they differ."""
  dec, tokens, ref = setup
  N, W = 9, cfg.sliding_window
  n_dec = cfg.num_hidden_layers - dec.plan.num_encoder_layers
  logits, cache = dec.prefill(tokens[:, :N], T, depth="ced")
  err = np.abs(decode_from(dec, tokens, logits, cache, N) - ref[N - 1:]).max(-1)   # per position
  exact_from = N - 1 + (n_dec - 1) * (W - 1)
  assert exact_from < T
  print(f"bounded-replay max |Δlogit| by position {N - 1}…{T - 1}: {np.round(err, 6).tolist()}")
  assert err[0] > 100 * ATOL                     # the last prompt token already differs
  assert np.all(err[exact_from - (N - 1):] <= ATOL)


def test_generate_with_the_stored_formats(cfg, setup):
  """Greedy decoding follows the forward pass; sampling with the stored formats (the default
  caches) is reproducible per seed; a decode step reads the codes: its logits move by more than
  rounding (by how much, with weights never trained under the quantizers, is printed: 0.33 at
  |logit| ≤ 3.6 here, through FP4 keys and the top-k they change)."""
  dec, tokens, ref = setup
  N = 11
  greedy = dec.generate(tokens[:, :N], 1, max_len=T, temperature=0.0, depth="full")
  assert greedy[0, 0] == ref[N - 1].argmax()
  stored = Decoder(M.init_model(cfg, 0), dec.moe_bias)
  a = stored.generate(tokens[:, :N], 4, max_len=T, temperature=0.8, top_p=0.9, seed=7, depth="full")
  b = stored.generate(tokens[:, :N], 4, max_len=T, temperature=0.8, top_p=0.9, seed=7, depth="full")
  np.testing.assert_array_equal(a, b)
  _, cache = stored.prefill(tokens[:, :N], T, "full")
  logits, _ = stored.step(cache, tokens, N)         # reads the FP4 / FP8 codes
  err = float(np.abs(np.asarray(logits)[0] - ref[N]).max())
  print(f"stored formats vs forward (quantizers off) at position {N}: max |Δlogit| {err:.5f} "
        f"of |logit| ≤ {np.abs(ref[N]).max():.2f}")
  assert err > ATOL


def test_top_p_keeps_the_nucleus():
  from dsv41_jax.inference import sample
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 2000)
  draws = np.asarray(jax.vmap(lambda k: sample(logits, k, 1.0, 0.7))(keys))[:, 0]
  assert set(draws.tolist()) == {0, 1}           # 0.5 < 0.7 ≤ 0.5 + 0.3: the top two only
  np.testing.assert_allclose((draws == 0).mean(), 0.5 / 0.8, atol=0.04)
