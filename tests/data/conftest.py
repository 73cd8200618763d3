"""Shared fixtures for the data tests: a small BPE (trained once per session) and tiny corpora."""

import base64
import json
import os

import ml_collections
import numpy as np
import pytest

from data import shapes
from data.config import DataConfig, data_config, data_defaults
from data.tokenizer import TokenizerHandle, train_bpe

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega def return import class yield").split()


def random_text(rng, n_words: int) -> str:
  return " ".join(WORDS[i] for i in rng.integers(len(WORDS), size=n_words))


@pytest.fixture(scope="session")
def small_tok() -> TokenizerHandle:
  rng = np.random.default_rng(0)
  texts = [random_text(rng, 200) for _ in range(50)]
  texts += [t for i in range(200) for t in shapes.segments_text(shapes.scene(0, "train", i))]
  return TokenizerHandle(train_bpe(texts, 320), source="test-bpe")


def write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def mm_record(i: int, split: str = "train") -> dict:
  s = shapes.scene(1, split, i)
  segs = shapes.segments(s)
  for seg in segs:
    if "image_bytes" in seg:
      seg["image_base64"] = base64.b64encode(seg.pop("image_bytes")).decode()
  return {"segments": segs}


def text_records(seed: int, n: int, rng_words=(3, 400)) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [{"text": f"doc {seed}-{i}: " + random_text(rng, int(rng.integers(*rng_words)))}
          for i in range(n)]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> str:
  """train/{text,mm}.jsonl and eval/{text,mm}.jsonl (small)."""
  root = tmp_path_factory.mktemp("corpus")
  for split, n_text, n_mm, seed in (("train", 40, 60, 1), ("eval", 24, 30, 2)):
    os.makedirs(root / split)
    write_jsonl(root / split / "text.jsonl", text_records(seed, n_text))
    write_jsonl(root / split / "mm.jsonl", [mm_record(i, split) for i in range(n_mm)])
  return str(root)


def make_cfg(corpus_dir: str, **data) -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.data = ml_collections.ConfigDict(data_defaults())
  cfg.data.seq_len = 128
  cfg.data.batch_size = 4
  cfg.data.pool_bins = 4
  cfg.data.text_sources = (os.path.join(corpus_dir, "train", "text.jsonl"),)
  cfg.data.multimodal_sources = (os.path.join(corpus_dir, "train", "mm.jsonl"),)
  cfg.data.text_eval_sources = (os.path.join(corpus_dir, "eval", "text.jsonl"),)
  cfg.data.multimodal_eval_sources = (os.path.join(corpus_dir, "eval", "mm.jsonl"),)
  for k, v in data.items():
    cfg.data[k] = v
  return cfg


def make_data(corpus_dir: str, **data) -> DataConfig:
  """`make_cfg`'s data section as the typed `DataConfig` the pipeline takes."""
  return data_config(make_cfg(corpus_dir, **data).data)
