"""Scaling ladders: a grid of model sizes × token budgets, and ablations at one size.

`get_config(arg)` answers two kinds of argument:

* a grid name, `cpu`, `gpu`, `gpu_lr2e-3` or `micro`: the ladder's spec (sizes, budgets, ablation
  size, seeds, XLA flags), read by `launch.ladder`;
* a point, `<grid>/<size>/<steps>` or `<grid>/<size>/<steps>/<ablation>`: the ordinary
  `launch.train` config of one run, e.g. `configs/ladder.py:cpu/L8d64/400`.

Every size keeps V4.1-Flash's structure, scaled by depth and width: `configs/small.py`'s `layout`
(two SWA layers, an encoder at compress ratio 2 and a decoder at ratio 1, Full / Reuse / Reindex
layers, Engram at layer 1 and ⌊0.35·L⌋, CED) at depth L, width d with head_dim 32 (the QAT block
sizes need a multiple of 32), d/16 heads and d/2 LoRA ranks and expert width. A point's
learning-rate schedule is its own: warm-up, hold to 60 % of its token budget, cosine decay to the
budget's end (`schedule_unit="tokens"`).

CPU ladder (9 points, text only, seq 128, batch 8):

  python -m launch.ladder --config=configs/ladder.py:cpu --workdir=/tmp/ladder_cpu
  python -m launch.ladder --config=configs/ladder.py:cpu --workdir=/tmp/ladder_cpu --ablations
  python -m launch.ladder --report /tmp/ladder_cpu --out=benchmarks/ladder

(benchmarks/RESULTS.md, "Scaling ladder and ablations on CPU": the 9 points took 35 min from a
cold compilation cache on a 2-core box shared with other jobs, 1-7 min a point; the 32 ablation
runs, 8 arms × 4 seeds, about 32 min.)

GPU ladder (one H200). Sized from measured H200 runs (benchmarks/RESULTS.md, "Train step on one
H200", 2026-11-30): start-up ~25 s, compilation 29-35 s, a step 0.19 s (L8d256) to 0.55 s
(L16d512) at 16 × 1024 tokens; so the largest point, L16d512 × 800 steps (13 M tokens), is
~8.5 min alone with its held-out evaluation, and the 9 points ~34 min one after another. Four at
a time (`--jobs=4`: start-up and compilation overlap the others' steps; each run's memory plan is
at most 16.6 GiB, its share 31 GiB), resumed over several 10-minute device calls
(benchmarks/gpu_runs/calls/next4.sh):

  python -m launch.ladder --config=configs/ladder.py:gpu --workdir=/tmp/ladder_gpu --jobs=4
  python -m launch.ladder --config=configs/ladder.py:gpu --workdir=/tmp/ladder_gpu --jobs=4 --sweep
  python -m launch.ladder --report /tmp/ladder_gpu --out=benchmarks/ladder/gpu

(`--list` prints each point's `launch.train` command instead; `--report` reads the finished work
directories, or the copies of their point.json and metrics.jsonl.)

The :gpu grid's peak rates are the learning-rate sweep's optima per chain and size (`lr` in GRIDS;
L16d512, never swept, borrows L12d384's and is flagged untuned). Its 9 points in
benchmarks/ladder/gpu ran before the sweep at 2e-3 for every size: `gpu_lr2e-3` is that grid. A
done point whose record says it trained at another chain or peak rate than its config now gives is
stale: `launch.ladder` marks it so (left out of the fits) and reruns it afresh.
"""

from __future__ import annotations

import math
import re

import jax
import ml_collections

from configs import common
from configs.small import layout

# LLVM's cheap passes: speed only (the numbers agree with the default flags to float rounding).
FAST_CPU = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# ... and XLA's elemental emitters instead of the newer fusion emitters: the micro train step
# compiles in ~10 s instead of ~22 s (loaded 2-core box), numbers again equal to float rounding
# (3e-7 in the parameters after 3 steps). Their steps are slower, so the cpu grid keeps FAST_CPU:
# at L10d96 compilation takes 13 s less but a step 2.14 s instead of 1.73 s (idle box), a loss
# from ~30 steps on. jax 0.11's XLA has only the fusion emitters: the flag is gone there, and an
# unknown XLA flag stops the process, so on jax 0.11 FASTER_CPU is FAST_CPU.
FASTER_CPU = FAST_CPU + (" --xla_cpu_use_fusion_emitters=false"
                         if jax.__version_info__ < (0, 11) else "")

# Each grid: sizes (name -> layers, width), budgets in steps, the batch and sequence of every point,
# the peak learning rate (`lr`: one for every size and chain, or per chain a table of sizes, see
# `peak_lr`) and warm-up, and the ablation size, budget and seeds.
GRIDS: dict[str, dict] = {
    # Widths 32-96 at depth 8-10: 0.2-1.4 M activated matrix parameters per token (head
    # included); budgets 60-240 steps of 1024 tokens. Compilation dominates a point on CPU (the
    # train step of L10d96 takes ~3 min to compile on a loaded 2-core machine), so the CPU grids
    # compile with LLVM's cheap passes (`xla_flags`: speed only, equal to float rounding).
    "cpu": dict(sizes={"L8d32": (8, 32), "L8d64": (8, 64), "L10d96": (10, 96)},
                steps=(60, 120, 240), seq=128, batch=8, lr=1e-2, warmup=10,
                ablation_size="L10d32", ablation_steps=60, seeds=(0, 1, 2, 3),
                xla_flags=FAST_CPU),
    # One H200: widths 256-512, seq 1024, batch 16 (16 K tokens a step); every point alone fits
    # one 10-minute device call (measured step times in the docstring).
    "gpu": dict(sizes={"L8d256": (8, 256), "L12d384": (12, 384), "L16d512": (16, 512)},
                steps=(200, 400, 800), seq=1024, batch=16, warmup=50,
                # Peak rate per chain and size, for grid points and ablations alike: each chain's
                # best rate of the sweep below at 400 steps, 2 seeds (issue 29; RESULTS "Muon
                # against AdamW, tuned", 2026-12-05; benchmarks/ladder/gpu/report.md): Muon
                # 2.5852 ± 0.0015 at L8d256, 2.5141 ± 0.0364 at L12d384; AdamW 2.7448 ± 0.0257
                # and 2.6578 ± 0.0299. L16d512 was never swept: it takes L12d384's rates, the
                # nearest swept size (`peak_lr`), and every record and report says so.
                lr=dict(muon={"L8d256": 4e-3, "L12d384": 8e-3},
                        adamw={"L8d256": 4e-3, "L12d384": 2e-3}),
                ablation_size="L12d384", ablation_steps=400, seeds=(0, 1), xla_flags="",
                # Muon against AdamW, tuned (issue 29): rates a factor 2 apart around each
                # chain's default, 400 steps (6.6 M tokens) at two sizes; the best at 2 seeds.
                # AdamW's 8e-3 was added when L8d256's optimum sat at 4e-3, the range's top
                # (2026-12-03, RESULTS "Muon against AdamW").
                sweep=dict(sizes=("L8d256", "L12d384"), steps=400, seeds=(0, 1), evals=4,
                           lrs={"muon": (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2),
                                "adamw": (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3)})),
    # The launch test's two points: configs/tiny.py:micro's scale (two layers, seq 32).
    "micro": dict(sizes={"L2d32": (2, 32)}, steps=(3, 6), seq=32, batch=4, lr=3e-3, warmup=1,
                  ablation_size="L2d32", ablation_steps=3, seeds=(0,), xla_flags=FASTER_CPU,
                  sweep=dict(sizes=("L2d32",), steps=4, seeds=(0, 1), evals=2,
                             lrs={"muon": (1e-3, 3e-3, 1e-2), "adamw": (1e-3, 3e-3, 1e-2)})),
}
# The :gpu grid as its 9 points ran (2026-12-03, benchmarks/ladder/gpu): one peak rate, 2e-3, for
# every size and chain, before the sweep. The ablations beside them ran at :gpu's L12d384 rates
# (Muon 8e-3, AdamW 2e-3) and the sweeps at their own, so `gpu` reproduces those; this grid's own
# ablations, at 2e-3, were never run.
GRIDS["gpu_lr2e-3"] = dict(GRIDS["gpu"], lr=2e-3)

ABLATIONS = ("dense_attention", "full_depth_kv", "engram_off", "plain_residual", "qat",
             "candidate_pool", "adamw", "bf16_streams")


def plan_fields(layers: int) -> dict:
  """The layer roles at depth `layers`: `configs/small.py`'s `layout`, or at depth 2 its smallest
  instance (configs/tiny.py:micro): an encoder Full layer at ratio 2 with Engram and a
  decoder Full layer at ratio 1."""
  if layers == 2:
    return dict(num_hidden_layers=2, compress_ratios=(2, 1), kv_source_layer_ids=(0, 1),
                index_source_layer_ids=(0, 1), candidate_source_layer_id=0, engram_layer_ids=(0,))
  return layout(layers)


def size_fields(layers: int, d: int, seq: int) -> dict:
  """ModelConfig fields of a ladder size: `layout(layers)` at width d (see the module docstring)."""
  heads = max(2, d // 16)
  return dict(
      vocab_size=2048,
      hidden_size=d,
      num_attention_heads=heads,
      head_dim=32,
      qk_rope_head_dim=16,
      q_lora_rank=d // 2,
      o_groups=max(1, heads // 2),
      o_lora_rank=d // 2,
      sliding_window=min(16 * seq // 128, seq),
      index_n_heads=2,
      index_head_dim=32,
      index_topk=8 * seq // 128,
      candidate_topk_blocks=4,
      candidate_block_size=2,
      yarn_enabled=False,  # pre-training: plain RoPE (docs/design.md §4.5)
      n_routed_experts=8,
      num_experts_per_tok=2,
      moe_intermediate_size=d // 2,
      # Capacity E / k: every buffer holds all tokens, the exact dropless function at einsum speed.
      moe_dispatch="capacity",
      moe_capacity_factor=4.0,
      engram_n_heads=2,
      engram_head_dim=max(8, d // 4),
      engram_vocab_size=1009,
      engram_compressed_vocab_size=2048,
      seq_len=seq,
      dtype="float32",
      **plan_fields(layers),
  )


def ablate(model: dict, name: str) -> dict:
  """Apply one ablation switch in place to a size's model fields; returns the `optim` fields the
  switch sets (an empty dict for the model switches).

  dense_attention  every layer plain causal attention: compress ratio 0 (no compressed branch,
                   no indexer) with the sliding window the whole sequence.
  full_depth_kv    no CED sharing: every decoder layer is a Full layer projecting its own
                   compressed KV (and indexer) from its own hidden state.
  engram_off       no Engram layers.
  plain_residual   the standard pre-norm residual, X ← X + F(norm(X)), one stream and no mHC
                   parameters (`residual="plain"`, hc_mult 1).
  qat              FP4 main KV and indexer, FP8 SWA KV fake quantization on (docs/design.md §9).
  candidate_pool   the hierarchical candidate pool on (docs/design.md §5.6).
  adamw            the optimizer: AdamW for every group instead of the Muon chain (`optim.chain`;
                   same schedule, weight decays and learning-rate multipliers).
  bf16_streams     the mHC streams stored in bfloat16 (`hc_stream_dtype`, docs/design.md §3.5):
                   a speed switch whose loss cost this arm measures.
  baseline         none: the ablations' reference point.
  """
  if name == "dense_attention":
    n = model["num_hidden_layers"]
    model.update(compress_ratios=(0,) * n, kv_source_layer_ids=(), index_source_layer_ids=(),
                 sliding_window=model["seq_len"])
  elif name == "full_depth_kv":
    n = model["num_hidden_layers"]
    dec = tuple(range(n // 2, n))
    model.update(kv_source_layer_ids=tuple(sorted(set(model["kv_source_layer_ids"]) | set(dec))),
                 index_source_layer_ids=tuple(sorted(set(model["index_source_layer_ids"])
                                                     | set(dec))))
  elif name == "engram_off":
    model.update(engram_layer_ids=())
  elif name == "plain_residual":
    model.update(residual="plain", hc_mult=1)
  elif name == "qat":
    model.update(fp4_main_kv=True, fp4_indexer=True, fp8_swa_kv=True)
  elif name == "candidate_pool":
    model.update(use_candidate_pool=True)
  elif name == "adamw":
    return {"chain": "adamw"}
  elif name == "baseline":
    pass
  elif name == "bf16_streams":
    model.update(hc_stream_dtype="bfloat16")
  else:
    raise ValueError(f"unknown ablation {name!r}; ablations are {ABLATIONS}")
  return {}


def peak_lr(grid: str, size: str, chain: str) -> tuple[float, str]:
  """The peak learning rate of `chain` at `size` in `grid`, and "" or why it is untuned.

  A grid's `lr` is one rate for every size and chain, or per chain a table of sizes (the sweep's
  best rates). A size missing from its chain's table takes the rate of the nearest size in it, by
  matrix parameters per layer × layers (layers · d², in log), and the note says so: the rate is
  a guess, not an optimum."""
  g = GRIDS[grid]
  if not isinstance(g["lr"], dict):
    return g["lr"], ""
  table = g["lr"][chain]
  if size in table:
    return table[size], ""
  def scale(name):
    layers, d = _parse_size(name)
    return math.log(layers * d * d)
  near = min(table, key=lambda s: abs(scale(s) - scale(size)))
  return table[near], f"untuned: no sweep at {size}, {near}'s rate"


def untuned(grid: str) -> dict[str, str]:
  """Size -> why its peak rates are untuned, for the grid's sizes that borrow a swept size's
  (`peak_lr`); empty for a grid with one rate or a table covering every size."""
  g = GRIDS[grid]
  chains = g["lr"] if isinstance(g["lr"], dict) else {}
  out = {}
  for size in dict.fromkeys([*g["sizes"], g["ablation_size"]]):
    notes = dict.fromkeys(n for n in (peak_lr(grid, size, chain)[1] for chain in chains) if n)
    if notes:
      out[size] = "; ".join(notes)
  return out


_SWEEP_ARM = re.compile(r"^(muon|adamw)_lr([0-9.]+(?:e[+-]?\d+)?)$")


def point_config(grid: str, size: str, steps: int, ablation: str | None = None
                 ) -> ml_collections.ConfigDict:
  """The `launch.train` config of one point: a size of `grid` trained for `steps` steps, with one
  ablation switch or a sweep arm `<chain>_lr<lr>` (`launch/sweep.py`: the chain at that peak
  rate, evaluated `sweep.evals` times along the budget)."""
  g = GRIDS[grid]
  sizes = dict(g["sizes"], **{g["ablation_size"]: _parse_size(g["ablation_size"])})
  if size not in sizes:
    raise ValueError(f"configs/ladder.py: grid {grid!r} has no size {size!r} (sizes: "
                     f"{sorted(sizes)})")
  layers, d = sizes[size]
  model = size_fields(layers, d, g["seq"])
  arm = _SWEEP_ARM.match(ablation or "")
  optim = (dict(chain=arm.group(1), lr=float(arm.group(2))) if arm
           else ablate(model, ablation) if ablation else {})
  lr, _ = peak_lr(grid, size, optim.get("chain", "muon"))
  cfg = common.base_config(model=model)
  cfg.optim.frozen = ()
  cfg.data.seq_len = g["seq"]
  cfg.data.batch_size = g["batch"]
  # Text only: the image stream keeps a token share that the mixer needs (> 0), its spans plain
  # tokens, and small image documents so the pipeline starts quickly.
  cfg.data.multimodal_weight = 0.05
  cfg.data.max_image_size = 42
  cfg.data.image_docs_train = 64
  cfg.data.image_docs_eval = 16
  cfg.train.steps = steps
  cfg.train.log_every = max(1, min(10, steps // 12))
  cfg.train.eval_every = steps           # held-out loss once, at the end of the budget
  cfg.train.eval_batches = 16
  cfg.train.checkpoint_every = max(1, steps // 2)
  cfg.train.keep_checkpoints = 1
  cfg.train.progress_bar = False
  cfg.optim.lr = lr
  cfg.optim.warmup_steps = min(g["warmup"], steps // 4)
  tokens = steps * g["batch"] * g["seq"]
  cfg.optim.schedule_unit = "tokens"
  cfg.optim.decay_start = 0.6 * tokens
  cfg.optim.decay_end = float(tokens)
  cfg.optim.update(optim)            # a sweep arm's chain and rate
  if arm:
    cfg.train.eval_every = max(1, steps // g["sweep"]["evals"])
  return cfg


def _parse_size(name: str) -> tuple[int, int]:
  """'L10d64' -> (10, 64)."""
  layers, d = name[1:].split("d")
  return int(layers), int(d)


def ladder_spec(grid: str) -> ml_collections.ConfigDict:
  """What `launch.ladder` reads: the grid's sizes, budgets, ablation size and seeds."""
  g = GRIDS[grid]
  spec = ml_collections.ConfigDict()
  spec.grid = grid
  spec.sizes = tuple(g["sizes"])
  spec.steps = tuple(g["steps"])
  spec.tokens_per_step = g["batch"] * g["seq"]
  spec.ablation_size = g["ablation_size"]
  spec.ablation_steps = g["ablation_steps"]
  spec.ablations = ABLATIONS
  spec.seeds = tuple(g["seeds"])
  spec.xla_flags = g["xla_flags"]  # appended to XLA_FLAGS of every point's run
  spec.untuned = untuned(grid)      # size -> why its peak rates are a guess (records, report)
  if "sweep" in g:                  # launch.ladder --sweep (launch/sweep.py)
    spec.sweep = ml_collections.ConfigDict(dict(g["sweep"], lrs=dict(g["sweep"]["lrs"])))
  return spec


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """A grid name (`GRIDS`): a ladder spec; `<grid>/<size>/<steps>[/<ablation>]`: one point."""
  arg = arg or "cpu"
  parts = arg.split("/")
  if parts[0] not in GRIDS:
    raise ValueError(f"configs/ladder.py:{arg}: unknown grid {parts[0]!r} (grids: {sorted(GRIDS)})")
  if len(parts) == 1:
    return ladder_spec(parts[0])
  if len(parts) not in (3, 4):
    raise ValueError(f"configs/ladder.py:{arg}: a point is <grid>/<size>/<steps>[/<ablation>]")
  return point_config(parts[0], parts[1], int(parts[2]), parts[3] if len(parts) == 4 else None)
