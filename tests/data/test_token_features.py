"""Engram hash ids made in the data pipeline (`token_features`, `launch.setup.EngramFeatures`):
per piece where the pieces are made, fixed up at cuts, padding from one run. Every batch's ids
equal `dsv41_jax.inputs.engram_ids` computed over its whole rows (the train loop's former path),
bit for bit: short rows (many cuts), image spans (dead tokens), padded evaluation rows, in the
main process and in a grain worker, and after a state restore."""

import json

import numpy as np
import pytest

from configs import tiny
from configs.common import model_config
from data import pipeline
from dsv41_jax import inputs
from launch import setup
from tests.data.conftest import make_data


def _features(small_tok):
  model = model_config(tiny.get_config("micro"))
  cmap = setup.compression_map(model, small_tok)
  return model, cmap, setup.EngramFeatures(model, cmap)


def _check(batch, model, cmap):
  want = inputs.engram_ids(model, batch["tokens"], batch["segment_ids"], batch["image_mask"], cmap)
  assert set(batch["engram_ids"]) == set(want) == set(model.engram_layer_ids)
  for layer, ids in want.items():
    np.testing.assert_array_equal(batch["engram_ids"][layer], ids)


@pytest.mark.parametrize("workers", [0, 1])
def test_pipeline_ids_equal_row_level_hashing(corpus_dir, small_tok, workers):
  model, cmap, features = _features(small_tok)
  cfg = make_data(corpus_dir, seq_len=32, batch_size=4, worker_count=workers)
  it = pipeline.make_train_iterator(cfg, tokenizer=small_tok, token_features=features)
  for _ in range(12):
    _check(next(it), model, cmap)
  c = it.counters()
  assert c["packer/cuts"] > 0 and c["row_tokens/multimodal"] > 0  # cuts and image spans seen
  state = json.loads(json.dumps(it.get_state()))
  want = next(it)
  it.close()
  again = pipeline.make_train_iterator(cfg, tokenizer=small_tok, token_features=features)
  again.set_state(state)
  got = next(again)
  again.close()
  for layer in want["engram_ids"]:
    np.testing.assert_array_equal(got["engram_ids"][layer], want["engram_ids"][layer])


def test_padded_eval_rows(corpus_dir, small_tok):
  model, cmap, features = _features(small_tok)
  cfg = make_data(corpus_dir, seq_len=64, batch_size=8, packer_cuts=False)
  batches = list(pipeline.make_eval_iterator(cfg, tokenizer=small_tok, token_features=features))
  assert any((b["segment_ids"] == 0).any() for b in batches)  # padding, empty tail rows
  for b in batches:
    _check(b, model, cmap)
