"""The SigLIP stage: pre-train the ViT contrastively before the LM run (docs/design.md §15.3;
the loss and the text tower are in `dsv41_jax/vision/siglip.py`).

  python -m launch.vit_pretrain --config=configs/tiny.py --workdir=/tmp/vit

Pairs: the default corpus's generated image–caption documents (`data/shapes.py`), each image sized
by the data pipeline's rule (`data/images.load_image`: 42-px cells within `data.max_image_size`)
and placed top-left on the pipeline's canvas, each caption tokenized by the pipeline's tokenizer.
Training reads the `train` split from index 0 on; evaluation holds out the first `--eval_pairs`
documents of the `eval` split.

Evaluation: image → caption retrieval among the held-out pairs. Each image picks the caption of
highest cosine similarity; a pick is correct when its text equals the image's own caption
(different scenes can share a caption text, e.g. one red circle in the center). Chance level is the
expected accuracy of a uniform pick, (1/N) Σ_i #{j : caption_j = caption_i} / N.

Output in `--workdir`: `vit/` (orbax checkpoint of the `vision/` parameters + `vision_config.json`),
which `load_vit(model, path)` puts into an LM `Transformer` with the same vision config, and
`siglip_results.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from configs.common import model_config
from data import images, pipeline, shapes
from data.config import data_config
from dsv41_jax.vision.config import VisionConfig
from dsv41_jax.vision.siglip import SigLIP, l2_normalize
from launch import cli


# Fields of VisionConfig that change how the ViT runs, not what its parameters are.
_RUNTIME_FIELDS = ("scan_layers", "remat")


def make_pairs(cfg, tok, split: str, start: int, n: int, max_len: int) -> dict:
  """n image–caption pairs of the default corpus, from document `start` of `split` on."""
  seed = cfg.data.seed
  count = cfg.data.image_docs_train if split == "train" else cfg.data.image_docs_eval
  canvas = images.max_cells(cfg.data.max_image_size) * images.CELL_PX
  out = {"pixels": np.zeros((n, canvas, canvas, 3), np.uint8), "cells": np.zeros((n, 2), np.int32),
         "tokens": np.zeros((n, max_len), np.int32), "mask": np.zeros((n, max_len), bool),
         "captions": []}
  for k in range(n):
    scene = shapes.scene(seed, split, (start + k) % count)
    pix = images.load_image(shapes.png_bytes(shapes.render(scene)), None, cfg.data.max_image_size)
    out["pixels"][k, :pix.shape[0], :pix.shape[1]] = pix
    out["cells"][k] = (pix.shape[0] // images.CELL_PX, pix.shape[1] // images.CELL_PX)
    text = shapes.caption(scene)
    ids = tok.encode(text)[:max_len]
    out["tokens"][k, :len(ids)] = ids
    out["mask"][k, :len(ids)] = True
    out["captions"].append(text)
  return out


def retrieval(model_state, graphdef, pairs: dict, chunk: int = 100) -> tuple[float, float]:
  """(image→caption accuracy, chance level) on `pairs` (module docstring)."""
  @jax.jit
  def embed(state, px, cells, tok, mask):
    m = nnx.merge(graphdef, state)
    return l2_normalize(m.embed_images(px, cells)), l2_normalize(m.embed_texts(tok, mask))

  xs, ys = [], []
  n = len(pairs["captions"])
  for a in range(0, n, chunk):
    x, y = embed(model_state, *(pairs[k][a:a + chunk] for k in ("pixels", "cells", "tokens", "mask")))
    xs.append(np.asarray(x))
    ys.append(np.asarray(y))
  sim = np.concatenate(xs) @ np.concatenate(ys).T
  caps = np.asarray(pairs["captions"])
  same = caps[:, None] == caps[None, :]
  acc = float(same[np.arange(n), sim.argmax(1)].mean())
  return acc, float(same.mean())


def save_vit(vit, path: str, vcfg: VisionConfig) -> str:
  """Write the ViT's parameters (orbax) and its config to directory `path`; returns `path`."""
  import orbax.checkpoint as ocp
  os.makedirs(path, exist_ok=True)
  tree = nnx.to_pure_dict(nnx.state(vit, nnx.Param))
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(os.path.abspath(path), "params"), tree, force=True)
  ckptr.wait_until_finished()
  with open(os.path.join(path, "vision_config.json"), "w") as f:
    json.dump(dataclasses.asdict(vcfg), f, indent=1)
  return path


def load_vit(model, path: str) -> None:
  """Replace `model.vision`'s parameters (an LM `Transformer` or anything holding a ViT at
  `.vision`) with the checkpoint at `path`; the vision configs must agree on every parameter
  shape-defining field, else ValueError."""
  import orbax.checkpoint as ocp
  with open(os.path.join(path, "vision_config.json")) as f:
    saved = VisionConfig(**json.load(f))
  mine = model.vision.cfg
  strip = lambda c: {k: v for k, v in dataclasses.asdict(c).items() if k not in _RUNTIME_FIELDS}
  if strip(saved) != strip(mine):
    diff = {k: (v, strip(mine)[k]) for k, v in strip(saved).items() if strip(mine)[k] != v}
    raise ValueError(f"ViT checkpoint {path}: its vision config differs from the model's "
                     f"(field: (checkpoint, model)) {diff}")
  state = nnx.state(model.vision, nnx.Param)
  target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
  restored = ocp.StandardCheckpointer().restore(os.path.join(os.path.abspath(path), "params"),
                                                target)
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(model.vision, state)


def _define_flags():
  """Command-line flags, defined only when run as a program (tests import this module beside
  other entry points that define --config too)."""
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
  flags.DEFINE_string("workdir", None, "Output directory.")
  flags.DEFINE_integer("steps", 400, "Training steps.")
  flags.DEFINE_integer("batch_size", 64, "Pairs per step (the sigmoid loss's N).")
  flags.DEFINE_float("lr", 2e-3, "Peak AdamW learning rate (warm-up 20 steps, cosine).")
  flags.DEFINE_integer("eval_pairs", 200, "Held-out pairs for retrieval.")
  flags.DEFINE_integer("max_text_len", 48, "Caption tokens kept.")
  flags.DEFINE_integer("seed", 0, "Parameter seed.")


def main(argv):
  del argv
  cfg = flags.FLAGS.config
  mc = model_config(cfg)
  if mc.vision is None:
    raise ValueError("the config has no vision tower (cfg.model.vision)")
  vcfg = mc.vision
  canvas = images.max_cells(cfg.data.max_image_size) * images.CELL_PX
  if canvas > vcfg.max_image_size:
    raise ValueError(f"data.max_image_size gives {canvas}-px canvases, more than "
                     f"vision.max_image_size={vcfg.max_image_size}")
  workdir = flags.FLAGS.workdir
  os.makedirs(workdir, exist_ok=True)
  tok = pipeline.make_tokenizer(data_config(cfg.data), mc.vocab_size)
  steps, bs, L = flags.FLAGS.steps, flags.FLAGS.batch_size, flags.FLAGS.max_text_len

  model = SigLIP(vcfg, int(cfg.model.vocab_size), nnx.Rngs(flags.FLAGS.seed))
  graphdef, state = nnx.split(model)
  params = nnx.as_pure(state)
  sched = optax.warmup_cosine_decay_schedule(0.0, flags.FLAGS.lr, min(20, steps // 2), steps,
                                             flags.FLAGS.lr * 0.1)
  tx = optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=1e-4)
  opt_state = tx.init(params)

  @jax.jit
  def step(p, o, px, cells, tokens, mask):
    loss, g = jax.value_and_grad(lambda p: nnx.merge(graphdef, p)(px, cells, tokens, mask))(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  held_out = make_pairs(cfg, tok, "eval", 0, flags.FLAGS.eval_pairs, L)
  acc0, chance = retrieval(params, graphdef, held_out)
  print(f"before training: retrieval {acc0:.3f} (chance {chance:.3f})", flush=True)
  t0, losses = time.time(), []
  for s in range(steps):
    b = make_pairs(cfg, tok, "train", s * bs, bs, L)
    params, opt_state, loss = step(params, opt_state, b["pixels"], b["cells"], b["tokens"],
                                   b["mask"])
    losses.append(float(loss))
    if s % 25 == 0 or s == steps - 1:
      print(f"step {s:4d} sigmoid loss {np.mean(losses[-25:]):.4f} ({time.time() - t0:.0f}s)",
            flush=True)
  acc, chance = retrieval(params, graphdef, held_out)
  print(f"after {steps} steps: image→caption retrieval {acc:.3f} on {flags.FLAGS.eval_pairs} held-out pairs "
        f"(chance {chance:.3f})", flush=True)
  nnx.update(model, params)
  path = save_vit(model.vision, os.path.join(workdir, "vit"), vcfg)
  result = {"steps": steps, "batch_size": bs, "lr": flags.FLAGS.lr, "eval_pairs": flags.FLAGS.eval_pairs,
            "retrieval_accuracy": acc, "retrieval_accuracy_before": acc0, "chance": chance,
            "final_loss": float(np.mean(losses[-25:])), "train_seconds": time.time() - t0,
            "checkpoint": path}
  with open(os.path.join(workdir, "siglip_results.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  _define_flags()
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=cli.parse_flags)
