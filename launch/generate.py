"""Sample from a pre-trained checkpoint: `load_model`, `generate` and the command line.

  python -m launch.generate --workdir=/tmp/dsv41_tiny --prompt="The river" --max_new_tokens=40
  python -m launch.generate --workdir=DIR --prompt="…" --temperature=0 --prefill=full

`load_model(workdir, step=None)` reads `DIR/config.json` (the run's resolved config) and restores
the parameters and MoE biases of the newest (or the given) checkpoint written by `launch.train`,
without its optimizer state or data iterator. Decoding uses `dsv41_jax.inference`: the caches in
their stored formats (FP4 main KV, MXFP4 indexer K, FP8 SWA) and, by default, the CED prefill
(encoder only, decoder by bounded replay of the last window, docs/design.md §5.7, §6); `--prefill=full`
runs the exact path instead. Bad input (a work directory without a checkpoint, a checkpoint of
another model, an empty prompt or one over the limit) stops with one line `error: …`, exit 2.

`--speculative` decodes with the DSpark drafter of `--drafter` (a `launch.train_drafter` work
directory; docs/design.md §16): `--verify_length=k` fixes the drafts verified per round, otherwise
the scheduler picks k each round from the confidence head and `--throughput_curve` (the JSON of
`benchmarks/dspark_throughput.py`; without one, k = draft_len). A drafter directory without a
checkpoint falls back to plain decoding with one warning (`--require_drafter`: an error); a
drafter trained on another width or vocabulary is an error naming it. `--stats` prints the
rounds, accepted drafts and backbone passes per token.

  python -m launch.generate --workdir=/tmp/dsv41_tiny --speculative --drafter=/tmp/dsv41_tiny_drafter \
      --prompt="The river" --temperature=0 --stats
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx

from configs.common import model_config
from dsv41_jax import model as model_lib
from dsv41_jax.inference import Decoder, cache as cache_lib
from launch import cli


class LoadError(ValueError):
  """The work directory or its checkpoint cannot serve as a model (the message says why)."""


@dataclasses.dataclass
class LoadedModel:
  """A restored model: `model` (trained config), `moe_bias` [L, 2, E], the run's `config`, its
  tokenizer and Engram compression map, and the checkpoint `step`."""

  model: nnx.Module
  moe_bias: jax.Array
  config: ml_collections.ConfigDict
  tokenizer: object
  compression_map: np.ndarray
  step: int

  def decoder(self) -> Decoder:
    """Caches in their stored formats (FP4 / MXFP4 / FP8) when the model's widths fit their
    blocks; otherwise (micro test models) caches of the forward pass's own values."""
    stored = cache_lib.fits_stored_formats(self.model.cfg) is None
    return Decoder(self.model, self.moe_bias, self.compression_map, stored_formats=stored)

  def limit(self) -> int:
    """Tokens of context the model was trained at: the prompt and its continuation fit in it."""
    return int(self.config.model.seq_len)


def checkpoint_steps(workdir: str) -> list[int]:
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _shape_mismatch(metadata, target) -> str | None:
  """The first leaf of `target` whose shape differs from the checkpoint's (orbax's `metadata` of a
  state directory), as "NAME is SHAPE there, SHAPE here"; None when all stored leaves agree."""
  tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
  key = lambda path: tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
  stored = {key(p): getattr(m, "shape", None) for p, m in jax.tree_util.tree_leaves_with_path(tree)}
  for p, x in jax.tree_util.tree_leaves_with_path(target):
    there = stored.get(key(p))
    if there is not None and tuple(there) != tuple(x.shape):
      return f"{jax.tree_util.keystr(p)} is {tuple(there)} there, {tuple(x.shape)} here"
  return None


def load_model(workdir: str, step: int | None = None,
               expected_model: dict | None = None) -> LoadedModel:
  """Restore parameters and MoE biases of checkpoint `step` (default: the newest) of `workdir`.

  `expected_model` (a config's `model` section) makes a work directory of another model an error.
  """
  from data.config import data_config
  from data.pipeline import make_tokenizer
  from dsv41_jax.engram.compression import build_compression_map
  import orbax.checkpoint as ocp

  path = os.path.join(workdir, "config.json")
  steps = checkpoint_steps(workdir)
  if not os.path.exists(path) or not steps:
    raise LoadError(f"{workdir} holds no checkpoint (expected {workdir}/config.json and "
                    f"{workdir}/checkpoints/<step>/ written by launch.train)")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise LoadError(f"{workdir} has no checkpoint of step {step} (steps {steps})")
  with open(path) as f:
    cfg = ml_collections.ConfigDict(json.load(f))
  if expected_model is not None:
    stored, given = dict(cfg.model), dict(expected_model)
    norm = lambda v: list(v) if isinstance(v, (list, tuple)) else v
    diff = sorted(k for k in set(stored) | set(given) if norm(stored.get(k)) != norm(given.get(k)))
    if diff:
      raise LoadError(f"{workdir} holds a checkpoint of another model (config.model differs in "
                      f"{diff[:8]})")
  mcfg = model_config(cfg)
  graphdef, abstract = nnx.split(model_lib.abstract_model(mcfg))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                   nnx.as_pure(abstract)),
            "moe_bias": jax.ShapeDtypeStruct((mcfg.num_hidden_layers, 2, mcfg.n_routed_experts),
                                             jnp.float32, sharding=device)}
  state_dir = os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state")
  try:
    # Shapes are compared before the read: orbax's read that fails on one array leaves the reads
    # of the others pending, to raise "Exception ignored in <coroutine ...>" at some later
    # garbage collection.
    if (differs := _shape_mismatch(ocp.PyTreeCheckpointer().metadata(state_dir), target)):
      raise LoadError(f"checkpoint {step} in {workdir} is not a checkpoint of the model in its "
                      f"config.json ({differs})")
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)
      restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True))
  except LoadError:
    raise
  except Exception as e:  # the stored tree does not fit this config's model
    first = (str(e).splitlines() or [""])[0][:200]
    raise LoadError(f"checkpoint {step} in {workdir} is not a checkpoint of the model in its "
                    f"config.json ({type(e).__name__}: {first})") from None
  missing = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(restored)
             if isinstance(x, jax.ShapeDtypeStruct)]
  if missing:  # a partial restore leaves what the checkpoint lacks unfilled
    raise LoadError(f"checkpoint {step} in {workdir} is not a checkpoint of the model in its "
                    f"config.json ({len(missing)} arrays missing, e.g. {missing[0]})")
  model = nnx.merge(graphdef, restored["params"])
  tok = make_tokenizer(data_config(cfg.data), mcfg.vocab_size)
  cmap = build_compression_map(lambda i: tok.decode([i]), tok.vocab_size,
                               raw_token=lambda i: tok.id_to_token(i) or "")
  return LoadedModel(model, restored["moe_bias"], cfg, tok, cmap, step)


def encode_prompt(loaded: LoadedModel, prompt: str) -> np.ndarray:
  """Token ids [N] of a prompt that leaves room for at least one new token within the limit."""
  if not prompt.strip():
    raise LoadError("the prompt is empty")
  ids = np.asarray(loaded.tokenizer.encode(prompt), np.int32)
  if len(ids) == 0:
    raise LoadError("the prompt encodes to no tokens")
  if len(ids) >= loaded.limit():
    raise LoadError(f"the prompt has {len(ids)} tokens; the limit is {loaded.limit() - 1} "
                    f"(model.seq_len {loaded.limit()} holds the prompt and at least one new token)")
  return ids


def generate(loaded: LoadedModel, prompts: list[str], max_new_tokens: int = 64, *,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
             prefill: str = "ced", decoder: Decoder | None = None, speculative=None,
             verify_length: int | None = None, stats=None) -> list[str]:
  """Continuations of `prompts` (each its own sequence; prompts of equal token length share a
  batch), stopping at end-of-document or at the model's context limit. `speculative`: a
  `dsv41_jax.inference.speculative.SpeculativeDecoder` to decode with (its `stats` collected)."""
  dec = decoder or (None if speculative is not None else loaded.decoder())
  encoded = [encode_prompt(loaded, p) for p in prompts]
  out: list[str] = [""] * len(prompts)
  eos = loaded.tokenizer.eos_id
  for n in sorted({len(e) for e in encoded}):
    rows = [i for i, e in enumerate(encoded) if len(e) == n]
    kw = dict(max_len=loaded.limit(), temperature=temperature, top_p=top_p, seed=seed,
              eos_id=eos, depth=prefill)
    if speculative is not None:
      new = speculative.generate(np.stack([encoded[i] for i in rows]), max_new_tokens,
                                 verify_length=verify_length, stats=stats, **kw)
    else:
      new = dec.generate(np.stack([encoded[i] for i in rows]), max_new_tokens, **kw)
    for r, i in enumerate(rows):
      ids = [int(x) for x in new[r]]
      out[i] = loaded.tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids)
  return out


def speculative_decoder(loaded: LoadedModel, drafter_dir: str | None, required: bool,
                        curve_path: str | None, verify_length: int | None = None):
  """(SpeculativeDecoder, SpeculativeStats) for `--speculative`, or (None, None) after one warning
  when the drafter directory holds no drafter and `required` is false."""
  from dsv41_jax.inference.scheduler import ThroughputCurve
  from dsv41_jax.inference.speculative import SpeculativeDecoder, SpeculativeStats
  from launch.drafter import DrafterMissing, DrafterStageError, load_drafter
  try:
    if not drafter_dir:
      raise DrafterMissing("--speculative needs --drafter=DIR (a launch.train_drafter work "
                           "directory)")
    drafter = load_drafter(drafter_dir, loaded)
  except DrafterMissing as e:
    if required:
      raise LoadError(str(e)) from None
    print(f"warning: {e}; decoding without speculation", file=sys.stderr)
    return None, None
  except DrafterStageError as e:
    raise LoadError(str(e)) from None
  try:
    curve = ThroughputCurve.load(curve_path) if curve_path else None
    spec = SpeculativeDecoder(loaded.decoder(), loaded.model, drafter, curve)
  except (OSError, ValueError) as e:
    raise LoadError(str(e)) from None
  if verify_length is not None and not 0 <= verify_length <= spec.K:
    raise LoadError(f"--verify_length={verify_length} must be in 0 … {spec.K} (the drafter's "
                    "draft_len)")
  return spec, SpeculativeStats()


def define_flags() -> None:
  """The command line's flags (defined only when run as a program, so the module imports cleanly)."""
  flags.DEFINE_string("workdir", None, "Work directory of a launch.train run.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
  flags.DEFINE_string("prompt", None, "Text to continue.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
  flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).")
  flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_enum("prefill", "ced", ["ced", "full"],
                    "ced: encoder + bounded decoder replay; full: the exact path.")
  flags.DEFINE_bool("speculative", False, "Decode speculatively with the DSpark drafter.")
  flags.DEFINE_string("drafter", None, "Work directory of launch.train_drafter (--speculative).")
  flags.DEFINE_bool("require_drafter", False, "--speculative without a drafter is an error.")
  flags.DEFINE_integer("verify_length", None, "Drafts verified per round (default: scheduled).")
  flags.DEFINE_string("throughput_curve", None, "benchmarks/dspark_throughput.py JSON (scheduler).")
  flags.DEFINE_bool("stats", False, "Print the speculative rounds and acceptance (stderr).")


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)   # orbax logs every read at INFO
  f = flags.FLAGS
  try:
    if not f.prompt.strip():
      raise LoadError("the prompt is empty")      # before the slow restore
    loaded = load_model(f.workdir, f.step)
    spec, stats = (speculative_decoder(loaded, f.drafter, f.require_drafter, f.throughput_curve,
                                       f.verify_length) if f.speculative else (None, None))
    text = generate(loaded, [f.prompt], f.max_new_tokens, temperature=f.temperature,
                    top_p=f.top_p, seed=f.seed, prefill=f.prefill, speculative=spec,
                    verify_length=f.verify_length, stats=stats)[0]
    if stats is not None and f.stats:
      print(f"speculative: {stats.rounds} rounds, {stats.tokens} tokens, mean accepted "
            f"{stats.mean_accepted:.2f} drafts per round, {stats.passes_per_token:.3f} backbone "
            f"passes per token (plain decoding: 1)", file=sys.stderr)
  except LoadError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if cache_lib.fits_stored_formats(loaded.model.cfg):
    print(f"note: {cache_lib.fits_stored_formats(loaded.model.cfg)}; the caches held the forward "
          "pass's own values", file=sys.stderr)
  print(f.prompt + text)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir", "prompt"])
  app.run(main, flags_parser=cli.parse_flags)
