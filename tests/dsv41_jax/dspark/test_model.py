"""`dsv41_jax/dspark`: the drafter's decoding path equals its training pass; the losses against a
naive float64 loop.

Training runs every row of a sequence as an anchor at once (`Drafter.__call__`); decoding keeps a
ring of context rows per layer and adds a round's rows (`Drafter.extend`). The queries of anchor t
must get the same z and base logits both ways, whatever the rounds' sizes, once the ring wraps
(window 8 over 24 rows). Both are float32 over the same products grouped differently: 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.dspark.config import DrafterConfig, DrafterConfigError
from dsv41_jax.dspark.loss import draft_targets, drafter_losses
from dsv41_jax.dspark.model import draft, init_drafter

D, V, T, K = 16, 40, 24, 3


@pytest.fixture(scope="module")
def parts():
  dc = DrafterConfig(hidden_size=D, vocab_size=V, sliding_window=8, draft_len=K, num_heads=2,
                     markov_rank=4, confidence_width=8)
  drafter = init_drafter(dc, 0)
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(1, T, D)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32)
  embed = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(D, V)) / 4, jnp.float32)
  return dc, drafter, h, tokens, embed, head


def test_extend_in_rounds_equals_the_training_pass_at_each_anchor(parts):
  dc, drafter, h, tokens, embed, head = parts
  z_all, base_all = drafter(h, tokens, jnp.arange(T)[None], jnp.ones((1, T), jnp.int32), embed, head)
  cache = drafter.init_cache(1)
  h_prev = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
  S = K + 1
  first = 0
  for n in [3, 1, 4, 2, 4, 1, 3, 2, 4]:
    pad = lambda x: jnp.concatenate([x[:, first:first + n], jnp.zeros_like(x[:, :S - n])], axis=1)
    z, base, cache = drafter.extend(cache, pad(h_prev), pad(tokens), first, n, embed, head)
    anchor = first + n - 1
    np.testing.assert_allclose(np.asarray(z[0]), np.asarray(z_all[0, anchor]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(base[0]), np.asarray(base_all[0, anchor]), rtol=0,
                               atol=1e-5)
    first += n
  assert first == T


def test_greedy_draft_follows_the_markov_head(parts):
  dc, drafter, h, tokens, embed, head = parts
  z, base = drafter(h, tokens, jnp.arange(T)[None], jnp.ones((1, T), jnp.int32), embed, head)
  toks, dists, conf = draft(drafter, z[:, 5], base[:, 5], tokens[:, 5], K, jax.random.key(0), 0.0)
  prev = int(tokens[0, 5])
  for i in range(K):
    want = int(np.argmax(np.asarray(base[0, 5, i] + drafter.markov(jnp.asarray(prev)))))
    assert int(toks[0, i]) == want
    prev = want
  assert np.all((np.asarray(conf) > 0) & (np.asarray(conf) < 1))


def test_losses_against_a_naive_loop():
  rng = np.random.default_rng(1)
  B, Tn, Kn, Vn = 2, 7, 3, 5
  draft_logits = rng.normal(size=(B, Tn, Kn, Vn))
  conf = rng.normal(size=(B, Tn, Kn))
  back = rng.normal(size=(B, Tn, Vn))
  seg = np.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]], np.int32)
  mask = seg > 0
  mask[1, 6] = False                                     # the row's last token has no target
  tokens = rng.integers(0, Vn, (B, Tn)).astype(np.int32)
  prev, valid = draft_targets(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(mask), Kn)
  total, fig = drafter_losses(jnp.asarray(draft_logits, jnp.float32), jnp.asarray(conf, jnp.float32),
                              jnp.asarray(back, jnp.float32), valid)
  ce = bce = n = acc_len = anchors = 0.0
  for b in range(B):
    for t in range(Tn):
      alive = True
      for i in range(Kn):
        r = t + i
        ok = r < Tn and seg[b, r] == seg[b, t] and seg[b, t] > 0 and mask[b, r]
        assert bool(valid[b, t, i]) == ok
        anchors += ok and i == 0              # anchors with at least one draft to verify
        if r < Tn:
          assert int(prev[b, t, i]) == tokens[b, r]
        if not ok:
          alive = False
          continue
        P = np.exp(back[b, r]) / np.exp(back[b, r]).sum()
        logq = draft_logits[b, t, i] - np.log(np.exp(draft_logits[b, t, i]).sum())
        ce -= (P * logq).sum()
        a = float(np.argmax(logq) == np.argmax(P))
        c = 1 / (1 + np.exp(-conf[b, t, i]))
        bce -= a * np.log(c) + (1 - a) * np.log(1 - c)
        n += 1
        alive = alive and a == 1.0
        acc_len += alive
  np.testing.assert_allclose(float(fig["draft_loss"]), ce / n, rtol=1e-5)
  np.testing.assert_allclose(float(fig["confidence_loss"]), bce / n, rtol=1e-5)
  np.testing.assert_allclose(float(total), (ce + bce) / n, rtol=1e-5)
  np.testing.assert_allclose(float(fig["accepted_length"]), acc_len / anchors, rtol=1e-6)


def test_bad_config_names_the_field():
  with pytest.raises(DrafterConfigError, match="drafter.num_heads"):
    DrafterConfig(hidden_size=10, vocab_size=8, num_heads=4)
