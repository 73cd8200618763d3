"""Speculative generation (`inference/speculative.py`, `acceptance.py`, `scheduler.py`): greedy
speculative decoding returns plain greedy decoding's tokens; sampled speculative decoding draws
from the backbone's distribution.

The backbone is the inference tests' micro model (every CSA2 mode, Engram, the candidate pool)
with a 32-token vocabulary and its head scaled ×1.5, so that its next-token distributions are
peaked (the most likely token ~0.2: a wrong acceptance rule then moves mass visibly); the drafter
is random with a small random Markov head and its final norm scaled ×0.1, so its q is flat,
differs from the backbone's p and overlaps it enough that drafts are both accepted and rejected.
Caches hold the forward pass's values (`stored_formats=False`).

Distribution test: 3,000 independent requests of one prompt, 3 new tokens each, k = 2 drafts per
round (token 1 comes from the prefill; tokens 2 and 3 from the rounds: a first draft accepted or
corrected, a second accepted, corrected or drafted in a second round). The exact marginals of
tokens 2 and 3 come from plain decode steps over all 32 and 32² histories. A chi-square test per
token (cells with expected count < 5 pooled) must not reject at p < 1e-4. On a broken copy that
draws the correction from p instead of the residual (p − q)⁺ the test of token 2 fails (checked).
That test is slow; the default suite checks the rule's distribution on fixed p and q instead
(test_rejection_rule_emits_the_target_distribution) and the whole speculative path greedily.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as sps

from dsv41_jax import model as M, testing
from dsv41_jax.dspark.config import DrafterConfig
from dsv41_jax.dspark.model import init_drafter
from dsv41_jax.inference import Decoder, acceptance, cache as C, decode, scheduler
from dsv41_jax.inference.speculative import SpeculativeDecoder, SpeculativeStats

V, N, MAX_LEN = 32, 6, 32


@pytest.fixture(scope="module")
def setup():
  cfg = testing.tiny_config(index_head_dim=32, use_candidate_pool=True, candidate_source_layer_id=4,
                            candidate_block_size=2, candidate_topk_blocks=2,
                            moe_dispatch="capacity", moe_capacity_factor=2.0, vocab_size=V,
                            engram_compressed_vocab_size=V)
  # One jitted init on a one-device mesh: ~13 s here against ~43 s for the eager init, which
  # dispatches every op alone (its values differ from the eager ones by float rounding only).
  model = M.init_model(cfg, 0, mesh=testing.cpu_mesh({"data": 1}))
  model.head[...] = model.head[...] * 1.5
  bias = jnp.zeros((cfg.num_hidden_layers, 2, cfg.n_routed_experts))
  dec = Decoder(model, bias, stored_formats=False)
  drafter = init_drafter(DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=V, sliding_window=16,
                                       draft_len=3, num_heads=2, markov_rank=4,
                                       confidence_width=8), 1)
  drafter.markov_out[...] = jax.random.normal(jax.random.key(2), drafter.markov_out.shape) * 0.3
  drafter.final_norm.scale[...] = drafter.final_norm.scale[...] * 0.1   # a flat q: it overlaps p
  spec = SpeculativeDecoder(dec, model, drafter)
  prompt = np.random.default_rng(0).integers(0, V, (1, N)).astype(np.int32)
  return cfg, model, bias, dec, spec, prompt


def test_greedy_speculative_equals_plain_greedy(setup):
  """With a drafter whose Markov head holds the bigrams of the greedy output (right where a token
  has one successor, wrong elsewhere), so that drafts are both accepted and rejected."""
  cfg, model, bias, dec, _, prompt = setup
  prompts = np.concatenate([prompt, np.random.default_rng(5).integers(0, V, (1, N))]).astype(np.int32)
  want = dec.generate(prompts, 20, max_len=MAX_LEN, temperature=0, depth="full")
  table = np.zeros((V, V))
  for p, w in zip(prompts, want):
    seq = np.concatenate([p, w])
    np.add.at(table, (seq[:-1], seq[1:]), 1.0)
  drafter = init_drafter(DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=V, sliding_window=16,
                                       draft_len=3, num_heads=2, markov_rank=V,
                                       confidence_width=8), 3)
  drafter.final_norm.scale[...] = drafter.final_norm.scale[...] * 0.1
  drafter.markov_in[...] = jnp.eye(V)
  drafter.markov_out[...] = jnp.asarray(8.0 * (np.arange(V) == table.argmax(1)[:, None]))
  spec = SpeculativeDecoder(dec, model, drafter)
  st = SpeculativeStats()
  got = spec.generate(prompts, 20, max_len=MAX_LEN, temperature=0, depth="full", verify_length=3,
                      stats=st)
  for r in range(2):
    np.testing.assert_array_equal(got[r], want[r])
  assert st.accepted > 0 and st.accepted < st.verified      # both outcomes happened
  got = spec.generate(prompts, 20, max_len=MAX_LEN, temperature=0, depth="full", verify_length=1)
  for r in range(2):
    np.testing.assert_array_equal(got[r], want[r])
  # The scheduler's choice (a curve where longer rounds cost more) gives the same tokens.
  spec.curve = scheduler.ThroughputCurve((1, 2), ((1.0, 1.3, 1.6, 1.9),) * 2)
  got = spec.generate(prompts, 20, max_len=MAX_LEN, temperature=0, depth="full")
  for r in range(2):
    np.testing.assert_array_equal(got[r], want[r])


def _exact_marginals(cfg, model, bias, dec, prompt):
  """P(token 2), P(token 3) of plain sampling at temperature 1, from decode steps over every
  history (token 1 from the prefill's logits)."""
  graphdef, params = nnx.split(model)
  step = jax.jit(lambda c, tok, t, ids: decode.decode_step(nnx.merge(graphdef, params), c, tok, t,
                                                           ids, bias))
  cache = C.init_cache(cfg, 1, MAX_LEN, stored_formats=False)
  out = dec._prefill(dec.params, cache, jnp.asarray(prompt), dec.engram_ids(prompt), dec.moe_bias,
                     "full")
  p1 = np.asarray(jax.nn.softmax(out["last_logits"]))[0]
  rows = lambda c, n: jax.tree.map(lambda a: jnp.repeat(a, n, 0) if a.ndim > 1 else a, c)
  hist1 = np.concatenate([np.repeat(prompt, V, 0), np.arange(V)[:, None]], 1).astype(np.int32)
  lg, c1 = step(rows(out["cache"], V), jnp.asarray(hist1[:, N]), jnp.int32(N),
                dec._token_engram_ids(hist1, N))
  p2 = np.asarray(jax.nn.softmax(lg))                                   # [x1, x2]
  hist2 = np.concatenate([np.repeat(hist1, V, 0), np.tile(np.arange(V), V)[:, None]], 1)
  lg, _ = step(rows(c1, V), jnp.asarray(hist2[:, N + 1]), jnp.int32(N + 1),
               dec._token_engram_ids(hist2.astype(np.int32), N + 1))
  p3 = np.asarray(jax.nn.softmax(lg)).reshape(V, V, V)                  # [x1, x2, x3]
  joint12 = p1[:, None] * p2
  return joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))


def _chi2_p(counts, probs):
  exp = probs * counts.sum()
  big = exp >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(exp[big], exp[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.slow  # ~100-190 s on 2 cores: 3,000 requests through the models; the rule's own
# distribution is test_rejection_rule_emits_the_target_distribution's, in the default suite
def test_sampled_speculative_matches_the_backbone_distribution(setup):
  cfg, model, bias, dec, spec, prompt = setup
  R = 3000
  P2, P3 = _exact_marginals(cfg, model, bias, dec, prompt)
  st = SpeculativeStats()
  got = spec.generate(np.repeat(prompt, R, 0), 3, max_len=MAX_LEN, temperature=1.0, top_p=1.0,
                      seed=7, depth="full", verify_length=2, stats=st)
  got = np.stack(got)
  assert got.shape == (R, 3)
  print('acceptance', st.accepted / st.verified)
  assert 0.2 < st.accepted / st.verified < 0.9                # the rule both accepts and rejects
  for col, P in ((1, P2), (2, P3)):
    counts = np.bincount(got[:, col], minlength=V).astype(np.float64)
    assert _chi2_p(counts, P) > 1e-4, (col, counts, P * R)


def test_rules_on_fixed_distributions():
  """Greedy: the leading matches and the argmax after them; the cap k_B stops a row early."""
  lg = jnp.asarray(np.eye(4)[[2, 1, 3, 0]][None] * 5.0)                 # argmax 2, 1, 3, 0
  n, nxt = acceptance.greedy_accept(jnp.asarray([[2, 1, 0]]), lg)
  assert (int(n[0]), int(nxt[0])) == (2, 3)
  n, nxt = acceptance.greedy_accept(jnp.asarray([[2, 1, 3]]), lg, jnp.asarray([1]))
  assert (int(n[0]), int(nxt[0])) == (1, 1)
  # Sampling with q = p accepts everything and draws the bonus from p_{k+1}.
  p = jax.nn.softmax(lg, -1)
  n, nxt = acceptance.rejection_accept(jnp.asarray([[2, 1, 3]]), p[:, :3], p, jax.random.key(0))
  assert int(n[0]) == 3


def test_rejection_rule_emits_the_target_distribution():
  """The sampling rule alone, on fixed distributions: 200,000 rounds of k = 2 drafts from q
  (other than p, and zero where p is not: rejected drafts and a non-trivial residual), a third
  of the rows capped at k_B = 1. The first emitted token (d_1 or the correction) must follow p_1
  and the second (d_2, the correction at 2, or the bonus) p_2: chi-square at p < 1e-4, as the
  end-to-end test. A broken copy that draws the correction from p instead of (p − q)⁺ fails
  token 1's chi-square; one that accepts d_i with probability p_i(d_i) alone fails (checked)."""
  V, R, rng = 8, 200_000, np.random.default_rng(11)
  p = rng.dirichlet(np.ones(V), 3)                        # p_1, p_2, p_3 (the bonus after d_2)
  q = rng.dirichlet(np.ones(V), 2)
  q[0, 0] = 0.0                                           # a token only p proposes
  q /= q.sum(-1, keepdims=True)
  kd, ka = jax.random.split(jax.random.key(3))
  drafts = jax.random.categorical(kd, jnp.log(jnp.asarray(q, jnp.float32)), shape=(R, 2),
                                  axis=-1).astype(jnp.int32)
  k_B = jnp.asarray(rng.integers(0, 3, R) == 0, jnp.int32) + 1   # 1 for a third, else 2
  rows = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (R,) + x.shape)
  n, nxt = jax.jit(acceptance.rejection_accept)(drafts, rows(q), rows(p), ka, k_B)
  n, nxt, d = np.asarray(n), np.asarray(nxt), np.asarray(drafts)
  assert 0.1 < (n == 0).mean() < 0.9 and (n == 2).mean() > 0.02   # both outcomes, both places
  first = np.where(n >= 1, d[:, 0], nxt)
  second = np.where(n >= 2, d[:, 1], nxt)[n >= 1]
  for tokens, P in ((first, p[0]), (second, p[1])):
    assert _chi2_p(np.bincount(tokens, minlength=V).astype(np.float64), P) > 1e-4


def test_scheduler_maximises_expected_tokens_per_second():
  conf = np.array([[0.9, 0.8, 0.5, 0.1]])
  S = scheduler.survival(conf)
  np.testing.assert_allclose(S[0], [0.9, 0.72, 0.36, 0.036])
  seconds = np.array([1.0, 1.1, 1.2, 1.3, 1.4])
  k, rate = scheduler.choose_length(S, seconds)
  want = (1 + np.concatenate([[0], np.cumsum(S[0])])) / seconds
  np.testing.assert_allclose(rate, want)
  assert k == int(np.argmax(want)) == 3
  assert scheduler.choose_length(S, seconds, max_k=1)[0] == 1
