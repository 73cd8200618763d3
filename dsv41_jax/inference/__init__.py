"""Inference: decode caches in their stored formats, prefill and decode (docs/design.md §5.7, §6,
§9–§10, §16.3), and a `Decoder` that drives them for generation.

  cache.py   the global compressed KV (FP4 + E4M3, MXFP4 index K) and the FP8 SWA rings
  decode.py  prefill ("full" = exact path, "ced" = encoder only + bounded decoder replay) and
             decode over a span of Q tokens (the decode step is Q = 1), from the model's own layer
             functions

`Decoder` holds the split model and its jitted steps, computes the Engram hash rows of each new
token on the host (`dsv41_jax.inputs`, from its last `engram_max_ngram_size` tokens, all a token's
n-grams read) and samples (temperature, top-p). Text only, one document per row; the rows of a
batch share their length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import inputs
from dsv41_jax.inference import cache as cache_lib
from dsv41_jax.inference import decode
from dsv41_jax.inference.cache import DecodeCache


def sampling_logits(logits_BxV: jax.Array, temperature: float, top_p: float) -> jax.Array:
  """logits / temperature (float32), −∞ outside the smallest set of most likely tokens whose
  probability reaches `top_p` (nucleus sampling); softmax of it is the sampled distribution.
  Any leading shape; temperature > 0."""
  logits = logits_BxV.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_desc = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass of the more likely tokens
    cutoff = jnp.min(jnp.where(before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return logits


def sample(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
  """Token ids [B]: argmax at temperature 0; else a draw from `sampling_logits`."""
  if temperature <= 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, sampling_logits(logits_BxV, temperature, top_p),
                                axis=-1).astype(jnp.int32)


class Decoder:
  """A model with its MoE biases, ready to prefill and decode (module docstring); the caches in
  their stored formats, or (`stored_formats=False`) holding the forward pass's own values."""

  def __init__(self, model, moe_bias_Lx2xE: jax.Array, compression_map: np.ndarray | None = None,
               stored_formats: bool = True):
    self.cfg = model.cfg
    self.stored_formats = stored_formats
    self.plan = model.plan
    self.compression_map = compression_map
    self.moe_bias = jnp.asarray(moe_bias_Lx2xE)
    graphdef, self.params = nnx.split(model)
    merge = functools.partial(nnx.merge, graphdef)
    self._prefill = jax.jit(
        lambda p, c, tok, ids, b, depth: decode.prefill(merge(p), c, tok, ids, b, depth=depth),
        static_argnums=(5,))
    self._decode = jax.jit(lambda p, c, tok, t, ids, b: decode.decode_step(merge(p), c, tok, t, ids, b),
                           donate_argnums=(1,))
    self._sample = jax.jit(sample, static_argnums=(2, 3))

  # --- host-side inputs ---

  def engram_ids(self, tokens_BxT: np.ndarray) -> dict[int, np.ndarray]:
    tokens = np.asarray(tokens_BxT)
    if not self.cfg.engram_layer_ids:
      return {}
    return inputs.engram_ids(self.cfg, tokens, np.ones(tokens.shape, np.int32), None,
                             self.compression_map)

  def _token_engram_ids(self, history_BxT: np.ndarray, t: int) -> dict[int, np.ndarray]:
    lo = max(0, t + 1 - self.cfg.engram_max_ngram_size)
    return {l: ids[:, -1:] for l, ids in self.engram_ids(history_BxT[:, lo:t + 1]).items()}

  # --- prefill and decode ---

  def prefill(self, tokens_BxN: np.ndarray, max_len: int, depth: str = "ced"
              ) -> tuple[jax.Array, DecodeCache]:
    """(logits [B, V] of the last prompt token, caches holding the prompt)."""
    tokens = np.asarray(tokens_BxN, np.int32)
    cache = cache_lib.init_cache(self.cfg, tokens.shape[0], max_len, self.stored_formats)
    out = self._prefill(self.params, cache, jnp.asarray(tokens), self.engram_ids(tokens),
                        self.moe_bias, depth)
    return out["last_logits"], out["cache"]

  def step(self, cache: DecodeCache, history_BxT: np.ndarray, t: int
           ) -> tuple[jax.Array, DecodeCache]:
    """Logits [B, V] of history[:, t] at position t, and the caches with it added."""
    token = jnp.asarray(np.asarray(history_BxT)[:, t], jnp.int32)
    return self._decode(self.params, cache, token, jnp.int32(t),
                        self._token_engram_ids(np.asarray(history_BxT), t), self.moe_bias)

  def generate(self, tokens_BxN: np.ndarray, max_new_tokens: int, *, max_len: int,
               temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
               eos_id: int | None = None, depth: str = "ced") -> np.ndarray:
    """New token ids [B, ≤ max_new_tokens] after the prompts (stops early when every row has
    produced `eos_id`, or at `max_len` tokens in all)."""
    tokens = np.asarray(tokens_BxN, np.int32)
    B, N = tokens.shape
    n_new = min(max_new_tokens, max_len - N)
    history = np.zeros((B, N + max(n_new, 0)), np.int32)
    history[:, :N] = tokens
    if n_new <= 0:
      return history[:, N:]
    logits, cache = self.prefill(tokens, max_len, depth)
    key = jax.random.key(seed)
    done = np.zeros((B,), bool)
    for i in range(n_new):
      key, sub = jax.random.split(key)
      nxt = np.asarray(self._sample(logits, sub, float(temperature), float(top_p)))
      history[:, N + i] = nxt
      if eos_id is not None:
        done |= nxt == eos_id
        if done.all():
          return history[:, N:N + i + 1]
      if i + 1 < n_new:
        logits, cache = self.step(cache, history, N + i)
    return history[:, N:]
