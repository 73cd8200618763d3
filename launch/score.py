"""Score text with a pre-trained checkpoint: mean loss (nats per predicted token) and bits per byte.

  python -m launch.score --workdir=/tmp/dsv41_tiny --data=texts.jsonl      # one {"text": …} a line

Each text is its own document: token i + 1 is predicted from tokens 0 … i (the first token is
context only). A text longer than the model's context (`model.seq_len`) is scored in consecutive
chunks of that length, each chunk's first token as context only. The figures use the training
run's own held-out formula (`launch.evaluation`: bits per byte = nats / ln 2 ÷ UTF-8 bytes of the
predicted tokens) and its evaluation step (`launch.step.make_eval_step`), one full forward pass
of rows of `seq_len` tokens (padding is segment 0: no loss, no expert load).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx

from dsv41_jax import inputs
from launch import cli, evaluation
from launch.generate import LoadError, LoadedModel, load_model
from launch.step import make_eval_step

ROWS_PER_BATCH = 8


def _rows(loaded: LoadedModel, texts: list[str]) -> list[np.ndarray]:
  T = loaded.limit()
  rows = []
  for text in texts:
    ids = np.asarray(loaded.tokenizer.encode(text), np.int32)
    rows += [ids[i:i + T] for i in range(0, max(len(ids) - 1, 0), T) if len(ids[i:i + T]) > 1]
  return rows


def _batches(loaded: LoadedModel, rows: list[np.ndarray]):
  T = loaded.limit()
  mcfg = loaded.model.cfg
  for b in range(0, len(rows), ROWS_PER_BATCH):
    chunk = rows[b:b + ROWS_PER_BATCH]
    tokens = np.zeros((ROWS_PER_BATCH, T), np.int32)
    seg = np.zeros((ROWS_PER_BATCH, T), np.int32)
    for r, ids in enumerate(chunk):
      tokens[r, :len(ids)] = ids
      seg[r, :len(ids)] = 1
    targets = np.concatenate([tokens[:, 1:], np.zeros((ROWS_PER_BATCH, 1), np.int32)], axis=1)
    loss_mask = (seg > 0) & (np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], axis=1) > 0)
    batch = dict(tokens=tokens, positions=np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape),
                 segment_ids=seg, targets=targets, loss_mask=loss_mask)
    if mcfg.engram_layer_ids:
      batch["engram_ids"] = inputs.engram_ids(mcfg, tokens, seg, None, loaded.compression_map)
    yield jax.tree.map(jnp.asarray, batch)


def score(loaded: LoadedModel, texts: list[str]) -> dict[str, float]:
  """{"loss", "bits_per_byte", "tokens"} of `texts` under the model (module docstring)."""
  rows = _rows(loaded, texts)
  if not rows:
    raise LoadError("nothing to score: every text has fewer than two tokens")
  graphdef, params = nnx.split(loaded.model)
  step = jax.jit(make_eval_step(loaded.model.cfg, graphdef))
  token_bytes = jnp.asarray(evaluation.token_byte_lengths(loaded.tokenizer,
                                                          loaded.model.cfg.vocab_size))
  return evaluation.evaluate(lambda b: step(params, loaded.moe_bias, b, token_bytes),
                             _batches(loaded, rows), 0)


def read_texts(path: str) -> list[str]:
  """The "text" field of every line of a JSON-lines file."""
  try:
    with open(path) as f:
      lines = [l for l in f if l.strip()]
  except OSError as e:
    raise LoadError(f"cannot read --data {path}: {e.strerror}") from None
  texts = []
  for n, line in enumerate(lines, 1):
    try:
      texts.append(json.loads(line)["text"])
    except (ValueError, KeyError, TypeError):
      raise LoadError(f"{path} line {n} is not a JSON object with a \"text\" field") from None
  if not texts:
    raise LoadError(f"{path} holds no text")
  return texts


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)   # orbax logs every read at INFO
  f = flags.FLAGS
  try:
    texts = read_texts(f.data)
    result = score(load_model(f.workdir, f.step), texts)
  except LoadError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps({"texts": len(texts), **result}))


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "Work directory of a launch.train run.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
  flags.DEFINE_string("data", None, "JSON-lines file, one {\"text\": ...} per line.")
  flags.mark_flags_as_required(["workdir", "data"])
  app.run(main, flags_parser=cli.parse_flags)
