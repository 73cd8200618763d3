"""Tests of launch/data_report.py: the figures it prints and its command line."""

import json
import os
import subprocess
import sys

import numpy as np

from launch import data_report
from tests.data.conftest import make_cfg

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_segment_lengths_reference():
  seg = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 3, 3, 3, 3]])
  np.testing.assert_array_equal(data_report.segment_lengths({"segment_ids": seg}),
                                [3, 2, 1, 1, 4])


def test_report_figures(corpus_dir, small_tok, tmp_path, monkeypatch):
  path = str(tmp_path / "tok.json")
  small_tok.save(path)
  cfg = make_cfg(corpus_dir, tokenizer_path=path, batch_size=3)
  r = data_report.report(cfg, 40)
  assert r["rows"] == 42 and r["padding_fraction"] == 0.0
  assert 0 < r["multimodal_token_share"] < 1 and r["tokens_per_second"] > 0
  assert r["skipped_records"] == 0 and r["skipped_at"] == {} and r["truncated_documents"] == 0
  assert r["segment_length"]["count"] == sum(r["segment_length"]["histogram"].values())
  i = r["image_slots"]
  counts = np.repeat(np.arange(i["per_row"] + 1), i["rows_by_images"])
  assert counts.size == 42 and i["mean_filled"] == counts.mean() > 0
  assert i["rows_without"] == np.mean(counts == 0) and i["rows_full"] == np.mean(counts == i["per_row"])
  assert "image slots" in data_report.format_text(r)
  assert "padding_fraction" in data_report.format_text(r)
  r["skipped_at"] = {"record_too_large": ["a.jsonl:3", "b.jsonl:9"]}
  assert "record_too_large       at a.jsonl:3, b.jsonl:9" in data_report.format_text(r)


def test_command_line_overrides(corpus_dir, small_tok, tmp_path):
  path = str(tmp_path / "tok.json")
  small_tok.save(path)
  d = corpus_dir
  args = [sys.executable, "-m", "launch.data_report", "--config=configs/tiny.py", "--rows=8",
          "--json", "--config.data.seq_len=256", f"--config.data.tokenizer_path={path}",
          f"--config.data.text_sources=('{d}/train/text.jsonl',)",
          f"--config.data.multimodal_sources=('{d}/train/mm.jsonl',)"]
  out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads(out.stdout)
  assert r["seq_len"] == 256 and r["rows"] == 8
  for key in ("padding_fraction", "multimodal_token_share", "tokens_per_second",
              "skipped_records", "segment_length"):
    assert key in r
  bad = subprocess.run(args[:-2] + ["--config.data.text_weight=0.0"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "text_weight" in bad.stderr


def test_engram_ids_as_the_train_loop():
  """`engram_ids` adds the model's Engram ids to each batch (launch.train's pipeline) and changes
  no row: the figures other than speed and the flag are those without them."""
  from configs import tiny
  cfg = tiny.get_config()
  with_ids, without = data_report.report(cfg, 8, engram_ids=True), data_report.report(cfg, 8)
  assert with_ids["engram_ids"] is True and without["engram_ids"] is False
  for k in ("rows", "padding_fraction", "multimodal_token_share", "segment_length", "packer",
            "documents"):
    assert with_ids[k] == without[k], k
