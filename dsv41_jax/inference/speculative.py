"""Speculative generation with the DSpark drafter (docs/design.md §16.3).

A round, for every request r in flight (pending token x_t at position t_r, not yet in the
backbone's caches):

  1. drafter  add the rows the last round accepted to the drafter's ring (`Drafter.extend`: their
              backbone hidden states and tokens) and draft K tokens with their confidences
              (`dspark.model.draft`); the scheduler picks the verification length k ≤ K from the
              confidences and the throughput curve (`scheduler.choose_length`), or k is fixed
  2. backbone verify [x_t, d_1 … d_k] at positions t … t+k in one pass (`verify.verify_span`),
              accept by the greedy or the sampling rule (`acceptance`), roll the caches back past
              the first rejection (`verify.rollback`); n accepted drafts and the next token give
              n + 1 new tokens, the next token becomes the pending one

Requests are independent sequences, each with its own position: every per-request function is
`jax.vmap`ped over a leading request axis, each request a batch of one. Engram rows of a span are
hashed on the host from the request's history, like `Decoder`'s. The drafter's first rows come
from the prefill's hidden states: every prompt row for the "full" prefill, the replayed rows for
"ced" (the drafter then starts at the replay's first row + 1, docs/design.md §16.3).

`SpeculativeStats` counts rounds and tokens and keeps every verified draft's confidence with its
realised acceptance (the calibration table).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import inputs
from dsv41_jax.dspark.model import Drafter, draft
from dsv41_jax.inference import Decoder, acceptance, sampling_logits, scheduler, verify
from dsv41_jax.inference import cache as cache_lib
from dsv41_jax.inference.scheduler import ThroughputCurve


@dataclasses.dataclass
class SpeculativeStats:
  """Per generate call: `rounds` (backbone passes after the prefill, counted per request),
  `tokens` (emitted by those rounds), `accepted` (drafts accepted), `verified` (drafts verified),
  `lengths` (k of each round), `seconds` (wall time of each round: drafter, host hashing,
  backbone pass, acceptance and rollback), and `calibration` rows (position i, confidence c_i,
  accepted) of every draft whose acceptance was decided."""

  rounds: int = 0
  tokens: int = 0
  accepted: int = 0
  verified: int = 0
  lengths: list = dataclasses.field(default_factory=list)
  seconds: list = dataclasses.field(default_factory=list)
  calibration: list = dataclasses.field(default_factory=list)

  @property
  def mean_accepted(self) -> float:
    return self.accepted / max(self.rounds, 1)

  @property
  def passes_per_token(self) -> float:
    return self.rounds / max(self.tokens, 1)


class SpeculativeDecoder:
  """A backbone (through its `Decoder`) and a DSpark drafter, generating speculatively (module
  docstring). `curve` (a measured `ThroughputCurve`) enables the scheduler; without it, or with
  `verify_length` given to `generate`, k is fixed."""

  def __init__(self, decoder: Decoder, model, drafter: Drafter, curve: ThroughputCurve | None = None):
    if drafter.dc.hidden_size != model.cfg.hidden_size or drafter.dc.vocab_size != model.cfg.vocab_size:
      raise ValueError(
          f"the drafter is for hidden_size {drafter.dc.hidden_size}, vocab_size "
          f"{drafter.dc.vocab_size}; the backbone has hidden_size {model.cfg.hidden_size}, "
          f"vocab_size {model.cfg.vocab_size}")
    if drafter.dc.draft_len + 1 > model.cfg.sliding_window:
      raise ValueError(f"drafter.draft_len {drafter.dc.draft_len} + 1 exceeds the backbone's "
                       f"sliding window ({model.cfg.sliding_window})")
    self.dec, self.cfg, self.curve = decoder, model.cfg, curve
    self.K = drafter.dc.draft_len
    graphdef, params = nnx.split(model)
    dgraph, self.dparams = nnx.split(drafter)
    self.params = params
    self.embed, self.head = model.embed[...], model.head[...]
    merge = functools.partial(nnx.merge, graphdef)
    dmerge = functools.partial(nnx.merge, dgraph)
    cfg, bias = model.cfg, decoder.moe_bias

    def draft_one(dp, dcache, h_prev_SxD, toks_S, first, n_new, prev, key, emb, head, temperature):
      d = dmerge(dp)
      z, base, dcache = d.extend(dcache, h_prev_SxD[None], toks_S[None], first, n_new, emb, head)
      toks, dists, conf = draft(d, z, base, prev[None], self.K, key, temperature)
      return toks[0], dists[0], conf[0], dcache

    def round_one(p, cache, toks_Q, t, ids, k_cap, q_kxV, key, temperature, top_p):
      lg, h, new, trail = verify.verify_span(merge(p), cache, toks_Q[None], t,
                                             {l: v[None] for l, v in ids.items()}, bias)
      drafts = toks_Q[None, 1:]
      if temperature <= 0:
        n, nxt = acceptance.greedy_accept(drafts, lg, k_cap[None])
      else:
        probs = jax.nn.softmax(sampling_logits(lg, temperature, top_p), axis=-1)
        n, nxt = acceptance.rejection_accept(drafts, q_kxV[None], probs, key, k_cap[None])
      kept = verify.rollback(cfg, cache, new, trail, t, n[0] + 1)
      return kept, n[0], nxt[0], h[0]

    batch_dcache = lambda f: jax.vmap(f, in_axes=(None, 0, 0, 0, 0, 0, 0, 0, None, None, None))
    self._draft = jax.jit(batch_dcache(draft_one), static_argnums=(10,))
    self._round = jax.jit(jax.vmap(round_one, in_axes=(None, 0, 0, 0, 0, 0, 0, 0, None, None)),
                          static_argnums=(8, 9))
    self._init_dcache = lambda R: jax.vmap(lambda _: drafter.init_cache(1))(jnp.arange(R))

  # --- host-side pieces ---

  def _span_ids(self, history: np.ndarray, t: np.ndarray, span: np.ndarray) -> dict:
    """Engram rows [R, Q, H] of each request's span (positions t_r … t_r+Q−1), hashed from the
    span and the request's last n−1 tokens before it (segment 0 pads a history shorter than that)."""
    cfg = self.cfg
    if not cfg.engram_layer_ids:
      return {}
    R, Q = span.shape
    back = cfg.engram_max_ngram_size - 1
    idx = t[:, None] - back + np.arange(back)[None]                     # [R, back]
    before = np.where(idx >= 0, history[np.arange(R)[:, None], np.maximum(idx, 0)], 0)
    window = np.concatenate([before, span], axis=1).astype(np.int32)
    seg = np.concatenate([(idx >= 0).astype(np.int32), np.ones((R, Q), np.int32)], axis=1)
    ids = inputs.engram_ids(cfg, window, seg, None, self.dec.compression_map)
    return {l: jnp.asarray(v[:, back:]) for l, v in ids.items()}

  def generate(self, tokens_RxN: np.ndarray, max_new_tokens: int, *, max_len: int,
               temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
               eos_id: int | None = None, depth: str = "ced", verify_length: int | None = None,
               stats: SpeculativeStats | None = None) -> list[np.ndarray]:
    """New token ids of each request (a list of [≤ max_new_tokens] arrays; a request stops at
    `eos_id` (kept) or at `max_len` tokens in all). `verify_length` fixes k; otherwise the
    scheduler picks it each round (k = K without a throughput curve)."""
    tokens = np.asarray(tokens_RxN, np.int32)
    R, N = tokens.shape
    stats = stats if stats is not None else SpeculativeStats()
    n_new = min(max_new_tokens, max_len - N)
    out: list[list[int]] = [[] for _ in range(R)]
    if n_new <= 0:
      return [np.zeros((0,), np.int32) for _ in range(R)]
    if verify_length is not None and not 0 <= verify_length <= self.K:
      raise ValueError(f"verify_length {verify_length} must be in 0 … {self.K} (drafter.draft_len)")
    dec = self.dec
    empty = cache_lib.init_cache(self.cfg, R, max_len, dec.stored_formats)
    pre = dec._prefill(dec.params, empty, jnp.asarray(tokens), dec.engram_ids(tokens),
                       dec.moe_bias, depth)
    logits, cache, hidden = pre["last_logits"], pre["cache"], pre["hidden"]   # hidden [R, rows, D]
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    pending = np.asarray(dec._sample(logits, sub, float(temperature), float(top_p)))
    history = np.zeros((R, max_len + self.K + 1), np.int32)
    history[:, :N] = tokens
    history[:, N] = pending
    for r in range(R):
      out[r].append(int(pending[r]))
    # One request per batch row: [R, 1, ...] caches, the ring positions [R, W] per request.
    W = self.cfg.sliding_window
    cache = jax.tree.map(lambda a: a[:, None] if a.ndim > 1 else jnp.broadcast_to(a, (R, W)), cache)
    # The drafter's first rows: j = first0 … N (x_N pending), each with h_{j−1} (0 at j = 0).
    rows = hidden.shape[1]
    first0 = 0 if rows == N else N - rows + 1
    h_prev = hidden if first0 else jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden], axis=1)
    new_rows = jnp.asarray(history[:, first0:N + 1])
    firsts = np.full((R,), first0, np.int32)
    n_rows = np.full((R,), N + 1 - first0, np.int32)
    dcache = self._init_dcache(R)
    t = np.full((R,), N, np.int32)
    done = np.zeros((R,), bool) if eos_id is None else pending == eos_id
    done |= np.array([len(o) >= n_new for o in out])
    while not done.all():
      t_round = time.perf_counter()
      key, kd, kr = jax.random.split(key, 3)
      drafts, dists, conf, dcache = self._draft(
          self.dparams, dcache, h_prev, new_rows, jnp.asarray(firsts), jnp.asarray(n_rows),
          jnp.asarray(pending), jax.random.split(kd, R), self.embed, self.head, float(temperature))
      conf = np.asarray(conf)
      room = int(np.min(np.where(done, max_len, max_len - 1 - t)))     # positions left
      if verify_length is not None:
        k = min(verify_length, room)
      elif self.curve is not None:
        active = ~done
        k, _ = scheduler.choose_length(scheduler.survival(conf[active]),
                                       self.curve.at(int(active.sum())), max_k=room)
      else:
        k = min(self.K, room)
      drafts_np = np.asarray(drafts)[:, :k]
      span = np.concatenate([pending[:, None], drafts_np], axis=1).astype(np.int32)
      ids = self._span_ids(history, t, span)
      cache, n, nxt, h = self._round(
          self.params, cache, jnp.asarray(span), jnp.asarray(t), ids,
          jnp.full((R,), k, jnp.int32), dists[:, :k], jax.random.split(kr, R),
          float(temperature), float(top_p))
      n, nxt = np.asarray(n), np.asarray(nxt)
      stats.seconds.append(time.perf_counter() - t_round)
      stats.lengths.append(k)
      for r in np.flatnonzero(~done):
        emitted = list(drafts_np[r, :n[r]]) + [int(nxt[r])]
        stats.rounds += 1
        stats.accepted += int(n[r])
        stats.verified += k
        for i in range(min(int(n[r]) + 1, k)):
          stats.calibration.append((i + 1, float(conf[r, i]), bool(i < n[r])))
        for tok in emitted:
          if done[r]:
            break
          out[r].append(int(tok))
          stats.tokens += 1
          if (eos_id is not None and tok == eos_id) or len(out[r]) >= n_new:
            done[r] = True
      # The accepted rows go to the drafter next round: h_{t..t+n} with x_{t+1..t+n+1}.
      S = self.K + 1
      rows_tok = np.zeros((R, S), np.int32)
      for r in range(R):
        acc = list(drafts_np[r, :n[r]]) + [int(nxt[r])]
        rows_tok[r, :len(acc)] = acc
        history[r, t[r] + 1:t[r] + 2 + n[r]] = acc
      h_prev = jnp.pad(h, ((0, 0), (0, S - h.shape[1]), (0, 0)))
      new_rows = jnp.asarray(rows_tok)
      firsts = t + 1
      n_rows = (n + 1).astype(np.int32)
      t = np.where(done, t, t + n + 1).astype(np.int32)
      pending = np.where(done, pending, nxt).astype(np.int32)
    return [np.asarray(o, np.int32) for o in out]
