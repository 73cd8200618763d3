"""Data pipeline throughput (docs/design.md §T3): tokens/s of packed rows on the default corpus,
with and without grain worker processes.

  python -m benchmarks.data_throughput            # seq_len 4096 x 1000 rows, workers 0 / 1 / 2
  python -m benchmarks.data_throughput --rows=200 --seq_lens=128 --workers=0

Each setting runs `launch.data_report.report` (tokens/s = row positions / seconds spent in
`next()`, setup excluded) in a fresh process, so worker pools and caches do not carry over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks.common import header, md_header  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 1000, "Packed rows per setting.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096"], "Row lengths to measure.")
_WORKERS = flags.DEFINE_list("workers", ["0", "1", "2"], "grain worker processes per stream.")
_CHILD = """
import json, sys
from absl import flags
flags.FLAGS.mark_as_parsed()
from configs import tiny
from launch.data_report import report
cfg = tiny.get_config()
cfg.data.seq_len, cfg.data.worker_count = {seq_len}, {workers}
print(json.dumps(report(cfg, {rows})))
"""


def run(seq_len: int, workers: int, rows: int) -> dict:
  code = _CHILD.format(seq_len=seq_len, workers=workers, rows=rows)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"seq_len={seq_len} workers={workers} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  print(header())
  print(md_header("seq_len", "batch", "workers/stream", "rows", "tokens/s", "batches/s",
                  "first batch", "padding", "mm share"))
  for seq_len in map(int, _SEQ_LENS.value):
    for workers in map(int, _WORKERS.value):
      r = run(seq_len, workers, _ROWS.value)
      per_batch = r["seq_len"] * r["batch_size"]
      print(f"| {seq_len} | {r['batch_size']} | {workers} | {r['rows']} | "
            f"{r['tokens_per_second']:,.0f} | {r['tokens_per_second'] / per_batch:,.1f} | "
            f"{r['first_batch_seconds']:.1f} s | "
            f"{r['padding_fraction']:.1e} | {r['multimodal_token_share']:.4f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
