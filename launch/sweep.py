"""Learning-rate sweeps of the optimizer chains at equal tokens (issue 29): which optimizer wins.

  python -m launch.ladder --config=configs/ladder.py:gpu --workdir=DIR --sweep     # run
  python -m launch.ladder --config=configs/ladder.py:gpu --workdir=DIR --sweep --list
  python -m launch.ladder --report DIR                                             # tables

A grid's `sweep` spec (`configs/ladder.py`) names sizes, one budget in steps, and per chain
("muon": head-wise Muon + AdamW + Sinkhorn momentum; "adamw": AdamW everywhere) a log-spaced list
of peak learning rates. Stage 1 trains every size × chain × rate at the first seed; stage 2
retrains each (size, chain)'s best rate at the other seeds, so the optimum's loss has a spread.
Every point is an ordinary `launch.train` run of the grid (`<grid>/<size>/<steps>/<chain>_lr<lr>`,
same data order, same tokens), evaluated on held-out data `sweep.evals` times along its budget.

The report, per size: each chain's sweep (held-out loss per rate), its best rate — flagged when it
sits at an edge of the range, since the optimum may then lie outside it — the best loss as mean ±
spread over seeds, and the tokens-to-target ratio: the tokens the winner's held-out curve needs to
reach the loser's final loss, over the budget (interpolated in log tokens between evaluations; 0.6
means the winner gets there with 40 % fewer tokens).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def arm(chain: str, lr: float) -> str:
  """A sweep point's fourth part of its config argument, as `configs/ladder.py` reads it."""
  return f"{chain}_lr{lr:g}"


def stage_one(spec, point_cls) -> list:
  """Every size × chain × rate at the first seed, cheapest size first."""
  s = spec.sweep
  seed = s.seeds[0]
  return [point_cls(f"sweeps/{size}_{arm(chain, lr)}_seed{seed}",
                    f"{spec.grid}/{size}/{s.steps}/{arm(chain, lr)}", seed, "sweep", size,
                    s.steps, arm(chain, lr), chain, float(lr))
          for size in s.sizes for chain in s.lrs for lr in s.lrs[chain]]


def best_rates(rows: list[dict[str, Any]], seed: int) -> dict[tuple[str, str], dict[str, Any]]:
  """(size, chain) → the finished stage-1 point with the lowest held-out loss at `seed`."""
  best: dict[tuple[str, str], dict[str, Any]] = {}
  for r in rows:
    if r.get("kind") != "sweep" or r.get("status") != "done" or r["seed"] != seed:
      continue
    key = (r["size"], r["chain"])
    if key not in best or r["eval_loss"] < best[key]["eval_loss"]:
      best[key] = r
  return best


def stage_two(spec, point_cls, records: list[dict[str, Any]]) -> list:
  """Each (size, chain)'s best stage-1 rate at the other seeds."""
  s = spec.sweep
  out = []
  for (size, chain), r in sorted(best_rates(records, s.seeds[0]).items()):
    for seed in s.seeds[1:]:
      out.append(point_cls(f"sweeps/{size}_{r['ablation']}_seed{seed}",
                           f"{spec.grid}/{size}/{s.steps}/{r['ablation']}", seed, "sweep", size,
                           s.steps, r["ablation"], chain, r["lr"]))
  return out


def _tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
  """First tokens at which a held-out curve [(tokens, loss)] reaches `target` (log-linear
  interpolation between evaluations), or None if it never does."""
  prev = None
  for d, loss in curve:
    if loss <= target:
      if prev is None or prev[1] == loss:
        return d
      (d0, l0), frac = prev, (prev[1] - target) / (prev[1] - loss)
      return math.exp(math.log(d0) + frac * (math.log(d) - math.log(d0)))
    prev = (d, loss)
  return None


def sweep_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per size and chain: the sweep, the best rate (edge flag), its loss over seeds, and per size
  the winner and its tokens-to-target ratio (see the module docstring)."""
  pts = [r for r in rows if r.get("kind") == "sweep" and r.get("status") == "done"]
  if not pts:
    return []
  seed0 = min(r["seed"] for r in pts)
  out = []
  for size in sorted({r["size"] for r in pts}):
    per_chain = []
    for chain in sorted({r["chain"] for r in pts if r["size"] == size}):
      mine = [r for r in pts if r["size"] == size and r["chain"] == chain]
      sweep = sorted((r["lr"], r["eval_loss"]) for r in mine if r["seed"] == seed0)
      if not sweep:
        continue
      lrs = [lr for lr, _ in sweep]
      best_lr = min(sweep, key=lambda x: x[1])[0]
      at_best = [r for r in mine if r["lr"] == best_lr]
      losses = np.array([r["eval_loss"] for r in at_best])
      per_chain.append(dict(
          size=size, chain=chain, sweep=sweep, best_lr=best_lr,
          edge=len(lrs) < 3 or best_lr in (lrs[0], lrs[-1]),
          best_loss_mean=float(losses.mean()),
          best_loss_spread=float(np.ptp(losses)) if len(losses) > 1 else None,
          seeds=sorted(r["seed"] for r in at_best),
          curves=[r.get("eval_curve", []) for r in at_best], tokens=at_best[0]["tokens"]))
    if len(per_chain) == 2:
      win, lose = sorted(per_chain, key=lambda c: c["best_loss_mean"])
      reach = [_tokens_to_reach(c, lose["best_loss_mean"]) for c in win["curves"] if c]
      reach = [d for d in reach if d is not None]
      ratio = float(np.mean(reach)) / win["tokens"] if reach else None
      for c in per_chain:
        c.update(winner=win["chain"], margin=lose["best_loss_mean"] - win["best_loss_mean"],
                 tokens_to_target=ratio)
    out += per_chain
  return out


def markdown(table: list[dict[str, Any]]) -> str:
  lines = ["| size | chain | sweep: lr → held-out loss (seed 0) | best lr | best loss (mean ± "
           "spread, seeds) | winner, margin, tokens-to-target |", "|---|---|---|---|---|---|"]
  for c in table:
    sweep = ", ".join(f"{lr:g} → {loss:.4f}" for lr, loss in c["sweep"])
    edge = " ⚠ at the edge of the range" if c["edge"] else ""
    spread = f" ± {c['best_loss_spread']:.4f}" if c["best_loss_spread"] is not None else ""
    verdict = "-"
    if "winner" in c:
      ttt = (f"{c['tokens_to_target']:.2f}× the tokens" if c["tokens_to_target"] is not None
             else "not reached within the evaluations")
      verdict = f"{c['winner']} by {c['margin']:.4f}; {ttt}"
    lines.append(f"| {c['size']} | {c['chain']} | {sweep} | {c['best_lr']:g}{edge} | "
                 f"{c['best_loss_mean']:.4f}{spread} ({','.join(map(str, c['seeds']))}) | "
                 f"{verdict} |")
  edges = [f"{c['size']}/{c['chain']}" for c in table if c["edge"]]
  if edges:
    lines.append(f"\nwarning: the best rate sits at an edge of its range for {', '.join(edges)}: "
                 "extend the range there before calling it the optimum")
  return "\n".join(lines) + "\n"


def eval_curve(metrics: dict[int, dict[str, Any]], tokens_per_step: float
               ) -> list[tuple[float, float]]:
  """[(tokens, held-out loss)] of a run's metrics, in step order."""
  return [(s * tokens_per_step, m["eval/loss"]) for s, m in sorted(metrics.items())
          if m.get("eval/loss") is not None and s > 0]
