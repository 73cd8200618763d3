"""Does the tiny multimodal model read its images? Caption loss with images vs images blanked.

  python -m launch.vit_pretrain --config=configs/tiny.py --workdir=/tmp/vit      # SigLIP stage
  python -m benchmarks.vision_multimodal --steps=600 --vit_checkpoint=/tmp/vit/vit

Two runs of the tiny config (configs/tiny.py: 12-layer LM, 2-layer ViT) on the default corpus,
identical in everything (seed, data order, initial weights, optimizer, budget) except that the
second run's images are blanked (every pixel 0) in training and evaluation. As in the report's
two-stage recipe, both ViTs may start from the SigLIP stage's checkpoint (`--vit_checkpoint`);
the ViT then trains jointly from the first step (no freeze here: the freeze is a schedule of the
long run, not what is measured). AdamW (warm-up 10 steps, cosine to 0.1×): the project's Muon
chain would only add CPU compile time. The mixture is shifted to 1 text : 4 multimodal tokens
(`--text_weight=0.25`) so a short run sees enough captions. `--variant=images` / `blank` runs one
half, so the two can run as parallel processes.

Metric: mean cross-entropy (nats) on held-out *caption tokens*, the loss-masked positions of a
multimodal document from its `<|image_end|>` token on (they predict the caption's tokens), over
`eval_batches` batches of the eval split. The captions name the count, colours, kinds and positions
of the shapes, which only the image tells.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs import common, tiny
from data import pipeline
from data.config import data_config
from dsv41_jax import inputs, model as M
from dsv41_jax.loss import objective
from dsv41_jax.vision.merge import check_image_batch
from optim import optim_config, update_moe_bias

KEYS = ("tokens", "positions", "segment_ids", "image_mask", "images", "image_count",
        "image_cells", "image_starts")


def caption_mask(b: dict) -> np.ndarray:
  """Loss positions of each image's document from its <|image_end|> token on (host, numpy)."""
  out = np.zeros_like(b["loss_mask"])
  T = out.shape[1]
  t = np.arange(T)
  for r in range(out.shape[0]):
    for k in range(int(b["image_count"][r])):
      s = int(b["image_starts"][r, k])
      end = s + int(b["image_cells"][r, k, 0] * b["image_cells"][r, k, 1])  # <|image_end|>
      seg = b["segment_ids"][r, s]
      out[r] |= (t >= end) & (b["segment_ids"][r] == seg)
  return out & b["loss_mask"]


def device_batch(mc, b: dict, blank: bool, vcfg) -> dict:
  b = dict(b)
  if blank:
    b["images"] = np.zeros_like(b["images"])
  check_image_batch(b, cell_px=vcfg.cell_px, max_image_size=vcfg.max_image_size)
  out = {k: jnp.asarray(b[k]) for k in KEYS + ("targets", "loss_mask")}
  out["engram_ids"] = {k: jnp.asarray(v) for k, v in inputs.engram_ids(
      mc, b["tokens"], b["segment_ids"], b["image_mask"]).items()}
  return out


def setup(args):
  """Config, model definition and the jitted steps, shared by both runs (one compile each)."""
  cfg = tiny.get_config()
  cfg.data.text_weight, cfg.data.multimodal_weight = args.text_weight, 1.0
  mc = common.model_config(cfg)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: M.Transformer(mc, nnx.Rngs(0))))
  # AdamW rather than the project's Muon chain: the comparison is about the images, and the
  # optimizer's many Newton–Schulz iterations would dominate CPU compile time.
  sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, 10, args.steps, args.lr * 0.1)
  tx = optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.0)
  gamma = optim_config(cfg.optim).moe_bias_gamma

  def loss_fn(p, bias, batch):
    logits, aux = nnx.merge(graphdef, p)({k: batch[k] for k in KEYS + ("engram_ids",)}, bias)
    total, _ = objective(mc, logits, aux, batch)
    return total, aux

  @jax.jit
  def step(p, o, bias, batch):
    (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p, bias, batch)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, update_moe_bias(bias, aux["load_2xE"], gamma), loss

  @jax.jit
  def eval_sums(p, bias, batch, mask):
    logits, _ = nnx.merge(graphdef, p)({k: batch[k] for k in KEYS + ("engram_ids",)}, bias)
    lse = jax.nn.logsumexp(logits, -1)
    picked = jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    return jnp.sum((lse - picked) * mask), jnp.sum(mask)

  return cfg, mc, tx, step, eval_sums


def run(blank: bool, args, setup_) -> dict:
  cfg, mc, tx, step, eval_sums = setup_
  model = M.Transformer(mc, nnx.Rngs(args.seed))
  if args.vit_checkpoint:   # the two-stage recipe: start the ViT from the SigLIP stage
    from launch.vit_pretrain import load_vit
    load_vit(model, args.vit_checkpoint)
  params = nnx.as_pure(nnx.split(model)[1])
  opt_state = tx.init(params)
  bias = M.zero_moe_bias(mc)
  data = data_config(cfg.data)
  it = pipeline.make_train_iterator(data, vocab_size=mc.vocab_size)
  t0 = time.time()
  losses = []
  for s in range(args.steps):
    params, opt_state, bias, loss = step(params, opt_state, bias,
                                         device_batch(mc, next(it), blank, mc.vision))
    losses.append(float(loss))
    if s % 25 == 0 or s == args.steps - 1:
      print(f"  [{'blank' if blank else 'image'}] step {s:4d} loss {np.mean(losses[-25:]):.3f} "
            f"({time.time() - t0:.0f}s)", flush=True)
  train_s = time.time() - t0
  ev = pipeline.make_eval_iterator(data, vocab_size=mc.vocab_size)
  tot = n = 0.0
  for _ in range(args.eval_batches):
    b = next(ev)
    a, c = eval_sums(params, bias, device_batch(mc, b, blank, mc.vision),
                     jnp.asarray(caption_mask(b)))
    tot, n = tot + float(a), n + float(c)
  return {"caption_loss": tot / max(n, 1), "caption_tokens": int(n), "train_s": train_s,
          "final_train_loss": float(np.mean(losses[-25:]))}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=150)
  ap.add_argument("--eval_batches", type=int, default=24)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--variant", choices=("both", "images", "blank"), default="both",
                  help="run both halves in turn, or one (the two can run as parallel processes)")
  ap.add_argument("--text_weight", type=float, default=0.25,
                  help="text tokens per multimodal token in the training mixture")
  ap.add_argument("--vit_checkpoint", default="",
                  help="start both runs' ViT from this launch.vit_pretrain checkpoint (workdir/vit)")
  args = ap.parse_args()
  res, su = {}, setup(args)
  variants = {"both": (False, True), "images": (False,), "blank": (True,)}[args.variant]
  for blank in variants:
    res[blank] = run(blank, args, su)
    print(("blanked" if blank else "images ") + f": {res[blank]}", flush=True)
  if len(variants) == 1:   # one half of the comparison (run the other with the same flags)
    return
  d = res[True]["caption_loss"] - res[False]["caption_loss"]
  print(f"caption loss: images {res[False]['caption_loss']:.3f} nats, blanked "
        f"{res[True]['caption_loss']:.3f} nats, difference {d:.3f} nats over "
        f"{res[False]['caption_tokens']} held-out caption tokens")


if __name__ == "__main__":
  main()
