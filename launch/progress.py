"""What a training run shows of its progress (launch.train): per-step timing, the logged records
(metrics.jsonl, TensorBoard, W&B), the log line or the progress bar, and the end-of-run summary.

Every figure comes from the function named beside it: tokens/s from the step timings, MFU from
`launch.metrics.mfu`, skipped records and truncated documents from the data iterator's counters
(`skipped_text`), the summary's held-out figures from the last evaluation (or metrics.jsonl).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import jax
import numpy as np

from data.pipeline import TRUNCATED
from dsv41_jax import flops
from launch import metrics as metrics_lib, setup
from optim.chain import learning_rates

log = logging.getLogger("dsv41.train")
STEP_LOG = "dsv41.train.step"  # per-step lines: off the terminal under the bar (train.log keeps them)
step_log = logging.getLogger(STEP_LOG)


class Progress:
  """Per-step timing, the logged records (metrics.jsonl, TensorBoard, W&B), the log line or the
  progress bar, and the figures of the end-of-run summary."""

  def __init__(self, run: setup.RunConfig, workdir: str, start: int, primary: bool,
               config: dict, train_it):
    """Opens the writers; metrics of steps after `start` (a lost run's) are rolled back."""
    self.run, self.train_it, self.primary = run, train_it, primary
    self.tokens_per_step = run.tokens_per_step
    self.flops_per_token = flops.train_flops_per_token(run.model.replace(seq_len=run.data.seq_len))
    self.peak = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind,
                                                  run.train.peak_flops_per_device)
    self.writer = metrics_lib.MetricWriter(workdir, primary, run.train.wandb_project, config,
                                           rollback_to=start)
    self.window = [0.0, 0.0, 0, 0.0, 0.0]  # seconds, data wait, steps, host data, dispatch
    self.losses: dict[int, float] = {}
    self.tokens_per_second: list[float] = []
    self.bar = None
    if primary and run.train.progress_bar and sys.stderr.isatty():
      from tqdm import tqdm
      self.bar = tqdm(total=run.train.steps, initial=start, dynamic_ncols=True, file=sys.stderr,
                      unit="step")

  def step(self, step: int, m: dict, seconds: float, data_wait: float,
           data_host: float = 0.0, dispatch: float = 0.0) -> None:
    """`data_wait`: seconds the step waited for its batch; `data_host`: seconds the host spent
    building the next batch beside the device's work (launch/train.py's look-ahead);
    `dispatch`: seconds the step's call took to return (near the whole step when the program
    makes the host wait for the device, e.g. for a `lax.cond`'s predicate on the GPU)."""
    self.window[0] += seconds
    self.window[1] += data_wait
    self.window[2] += 1
    self.window[3] += data_host
    self.window[4] += dispatch
    loss = float(m["loss"])
    self.losses[step] = loss
    if step % self.run.train.log_every == 0 or step == self.run.train.steps:
      self._log(step, m, loss)
    if self.bar is not None:
      self.bar.update(1)

  def _log(self, step: int, m: dict, loss: float) -> None:
    seconds, wait, n, host, dispatch = self.window
    step_time = seconds / n
    tps = self.tokens_per_step / step_time
    self.tokens_per_second.append(tps)
    record = {k: np.asarray(v) for k, v in m.items()}
    record.update(step_time=step_time, data_wait=wait / n, compute_time=(seconds - wait) / n,
                  data_host=host / n, dispatch_time=dispatch / n,
                  tokens_per_second=tps, tokens_seen=step * self.tokens_per_step)
    u = metrics_lib.mfu(self.flops_per_token, tps, jax.device_count(), self.peak)
    if u is not None:
      record["mfu"] = u
    record["lr"] = learning_rates(self.run.optim, step)
    record["data"] = self.train_it.counters()
    record["data"]["padding_fraction"] = (
        record["data"].get("padding_tokens", 0)
        / max(1, record["data"].get("rows", 0) * self.run.data.seq_len))
    self.writer.write(step, record)
    mfu = f" mfu {u:.2%}" if u is not None else ""
    skips = skipped_text(record["data"])
    step_log.info("process %d step %d loss %.4f step_time %.3f s (data wait %.3f s, next batch "
                  "on the host %.3f s, dispatch %.3f s) tokens/s %.0f%s%s", jax.process_index(),
                  step, loss, step_time, record["data_wait"], record["data_host"],
                  record["dispatch_time"], tps,
                  mfu, f"; {skips}" if skips else "")
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", step_s=f"{step_time:.3f}",
                           **({"mfu": f"{u:.2%}"} if u is not None else {}))
    self.window = [0.0, 0.0, 0, 0.0, 0.0]

  def eval(self, step: int, figures: dict[str, float]) -> None:
    self.writer.write(step, {f"eval/{k}": v for k, v in figures.items()})
    log.info("step %d held-out loss %.4f, %.4f bits/byte over %s tokens", step, figures["loss"],
             figures["bits_per_byte"], f"{int(figures['tokens']):,}")

  def close(self) -> None:
    self.writer.close()
    if self.bar is not None:
      self.bar.close()

  def figures(self) -> dict[str, Any]:
    tps = metrics_lib.median(self.tokens_per_second)
    return {"median_tokens_per_second": tps,
            "mfu": None if tps is None else metrics_lib.mfu(self.flops_per_token, tps,
                                                             jax.device_count(), self.peak)}


def skipped_text(counters: dict) -> str:
  """Skipped records by reason and truncated documents, from the data iterator's counters, as
  'skipped 3 records (malformed_json 2, invalid_utf8 1), 1 document cut at
  data.max_document_tokens'; '' when there are none."""
  skipped = {k.split("/", 1)[1]: int(v) for k, v in sorted(counters.items())
             if k.startswith("skipped/") and v}
  parts = []
  if skipped:
    n = sum(skipped.values())
    parts.append(f"skipped {n} record{'s' * (n != 1)} ("
                 + ", ".join(f"{k} {v}" for k, v in skipped.items()) + ")")
  cut = int(counters.get(TRUNCATED, 0))
  if cut:
    parts.append(f"{cut} document{'s' * (cut != 1)} cut at data.max_document_tokens")
  return ", ".join(parts)


def format_summary(s: dict[str, Any], workdir: str) -> str:
  """The end-of-run summary: steps, tokens, final train and held-out loss, bits per byte, median
  tokens/s, MFU, wall time and the share of it spent compiling. A run that had nothing left to
  train reports the last figures its metrics.jsonl holds."""
  first = (f"done (process {jax.process_index()}): steps {s['start_step']}→{s['end_step']} of "
           f"{s['steps']}")
  if s.get("interrupted"):
    first += f" (stopped by {s['interrupted']})"
  lines = [first]
  ran = s["end_step"] - s["start_step"]
  losses = s["losses"]
  if losses:
    last = max(losses)
    lines.append(f"  train loss   {losses[last]:.4f} at step {last}")
    lines.append(f"  tokens       {ran * s['tokens_per_step']:,} this run, "
                 f"{s['end_step'] * s['tokens_per_step']:,} in all")
  ev = dict(s["eval"])
  logged = metrics_lib.last_logged(workdir) if not losses or not ev else {}
  if not losses:
    where = (f"last logged loss {logged['loss']:.4f} at step {int(logged['step'])}"
             if "loss" in logged else "no loss logged in metrics.jsonl")
    lines.append(f"  nothing to train: the work directory is at step {s['end_step']} of "
                 f"train.steps = {s['steps']} ({where}); raise --config.train.steps to continue")
  if not ev and "eval/loss" in logged:
    ev = {"loss": logged["eval/loss"], "bits_per_byte": logged.get("eval/bits_per_byte")}
  if ev:
    bpb = ev.get("bits_per_byte")
    lines.append(f"  held-out     loss {ev['loss']:.4f}" + (
        f", {bpb:.4f} bits/byte" if bpb is not None else ""))
  if s.get("median_tokens_per_second"):
    mfu = s.get("mfu")
    # No peak is known for CPUs: no MFU there, and no advice to set one.
    mfu_text = (f", MFU {mfu:.2%}" if mfu is not None else
                "" if jax.devices()[0].platform == "cpu" else
                ", MFU n/a (set train.peak_flops_per_device)")
    lines.append(f"  throughput   {s['median_tokens_per_second']:,.0f} tokens/s (median of the "
                 f"logged windows){mfu_text}")
  skips = skipped_text(s.get("data", {}))
  if skips:
    lines.append(f"  data         {skips} (python -m launch.data_report lists where)")
  share = s["compile_seconds"] / s["seconds"] if s["seconds"] else 0.0
  lines.append(f"  wall time    {s['seconds']:.0f} s, compilation {s['compile_seconds']:.0f} s "
               f"({share:.0%})")
  return "\n".join(lines)
