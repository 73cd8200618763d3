"""Small models with V4.1-Flash's structure, for GPU runs and scaling ladders: 's1' … 's4'.

Every size keeps the released layout scaled to its depth L (docs/design.md §1-§2): two pure-SWA layers,
an encoder at compress ratio 2 and a decoder at ratio 1 (halves of L); a Full layer every 6
encoder layers from layer 2 plus the first decoder layer, a Reindex layer every 4 decoder layers,
Engram at layer 1 and at ⌊0.35·L⌋, the ViT + projector frozen until the decay. Width, experts and
tables shrink with the size:

  size  d     L   heads×dim  experts (k)  expert I  vocab   Engram rows/head  seq
  s1    512   12  8×128      16 (2)       256       16384    50 000           1024
  s2    768   16  12×128     32 (4)       384       32768   100 000           2048
  s3    1024  20  16×128     48 (4)       512       32768   150 000           2048
  s4    1536  24  16×192     64 (6)       768       65536   200 000           4096
  m3    1536  12  16×128     64 (6)       768       65536   200 000           4096

The mHC streams are stored in bfloat16 from s3 up (`hc_stream_dtype`, docs/design.md §3.5; s1 and
s2 keep float32): on one H200 s3's accumulated step 2,777 → 2,309 ms and m3's 15.2 % MFU, and the
s1 held-out loss over 4 seeds the same (+0.0001 ± 0.0047 nats, benchmarks/RESULTS.md). So are
the experts' products' outputs (`moe_product_dtype="compute"`, §8.2): s3's accumulated step
2,271.7 → 2,218.2 ms, m3's 2,841.0 → 2,766.4 ms (15.5 % MFU), and the s1 loss over 4 seeds the
same (−0.0035 ± 0.0043 nats). So is the router's product as six bfloat16 tensor-core products
(`router_precision="bf16_6x"`, §8.2): s3's step 1.4 % shorter, the s1 loss over 4 seeds the same
(−0.0091 ± 0.0114 nats). So are the weights cast to the compute dtype once a step with the
experts' gate/up pair (`cast_weights_once`) and the scan stacks and switch residual slots left
unfilled (`train.unfilled_buffers`): s3's accumulated step 2,113.8 → 1,985.1 ms (12.0 % MFU) on
one H200, and the s1 loss over 3 seeds the same (+0.0026 ± 0.0046 nats). From s3 up the ViT runs
over the filled image slots, 24 a row (`vision.slot_budget`, every slot when a micro-batch holds
more; the same embeddings up to float rounding): s3's launch.train at 8 × (4 × 4096) 2.35 → 2.32
s a step with the ViT frozen and 2.64 → 2.46 once it trains (one H100, session 59).

Ledger (`python -m launch.ledger --config=configs/small.py:s2`): total / Engram / activated
(decode) parameters and train FLOPs per token at the size's seq:
  s1 0.19 B / 77 M / 34 M, 2.4e8;   s2 0.80 B / 231 M / 129 M, 8.7e8;
  s3 2.19 B / 462 M / 265 M, 1.8e9; s4 7.29 B / 1.23 B / 892 M, 5.9e9;
  m3 4.44 B (backbone 3.07 B: MaxText ds4mini's 3.04 B scale) / 1.23 B / 510 M, 3.2e9.
m3 is the 3B-class config for one H200 (issue 28); its memory plan at a 4 × 4096 micro-batch
(`python -m launch.aot --config=configs/small.py:m3 --mesh=data:1 --batch=4 --analytic`):
parameters 16.6 GiB, gradients 16.6, optimizer 16.6, activations 36.5 (the bfloat16 streams
kept per layer 2.4, the float32 logits of one 8192-token loss chunk 6.0), 86.2 GiB in all (an
estimate: XLA's program for that micro-batch took 71.2 GiB on one H200, 2026-12-04). Launch (one
host, every local GPU in the batch/expert axes):

  python -m launch.train --config=configs/small.py:s1 --workdir=/tmp/dsv41_s1
  python -m launch.train --config=configs/small.py:s2 --workdir=DIR \
      --config.mesh.data=2 --config.mesh.expert=4 --config.data.batch_size=32
  python -m launch.aot --config=configs/small.py:s3 --mesh=data:2,expert:4   # memory

`accum` is `train.grad_accum_steps`, chosen so that the configured batch fits one H200 (micro-batches
of 16K-32K tokens; `launch.aot --analytic` plans it): s3's 64 × 2048 rows run as 8 micro-batches
of 8 rows, m3's 32 × 4096 as 8 of 4 (the 4 × 4096 plan above, plus the gradient accumulator). With n GPUs
in the batch axes divide it by n (`--config.train.grad_accum_steps=1` on 8). s4 needs several GPUs whatever
the micro-batch: its parameters, gradients and optimizer state alone are ~100 GiB.

The learning-rate schedule: warm-up `warmup_steps`, hold, cosine decay over the last 30 % of the
run. The decay window is a fraction of `train.steps` (at a fixed batch, the same as of the tokens),
so a command-line step change moves it with the run.
"""

from __future__ import annotations

import ml_collections

from configs import common

SIZES: dict[str, dict] = {
    "s1": dict(d=512, layers=12, heads=8, head_dim=128, experts=16, k=2, inter=256, vocab=16384,
               engram_rows=50_000, engram_heads=4, engram_dim=64, index_heads=8, index_dim=64,
               topk=128, seq=1024, batch=32, accum=1, streams="float32", products="float32",
               router="highest", once=False, lr=2e-3, steps=20_000,
               vit=dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024,
                        projector_hidden=1024)),
    "s2": dict(d=768, layers=16, heads=12, head_dim=128, experts=32, k=4, inter=384, vocab=32768,
               engram_rows=100_000, engram_heads=4, engram_dim=96, index_heads=8, index_dim=64,
               topk=256, seq=2048, batch=32, accum=2, streams="float32", products="float32",
               router="highest", once=False, lr=1.5e-3, steps=30_000,
               vit=dict(num_layers=6, hidden_size=384, num_heads=6, intermediate_size=1536,
                        projector_hidden=1536)),
    "s3": dict(d=1024, layers=20, heads=16, head_dim=128, experts=48, k=4, inter=512, vocab=32768,
               engram_rows=150_000, engram_heads=8, engram_dim=64, index_heads=16, index_dim=128,
               topk=256, seq=2048, batch=64, accum=8, streams="bfloat16", products="compute",
               router="bf16_6x", once=True, lr=1e-3, steps=40_000,
               vit=dict(num_layers=8, hidden_size=512, num_heads=8, intermediate_size=2048,
                        projector_hidden=2048, slot_budget=24)),
    "s4": dict(d=1536, layers=24, heads=16, head_dim=192, experts=64, k=6, inter=768, vocab=65536,
               engram_rows=200_000, engram_heads=8, engram_dim=128, index_heads=16, index_dim=128,
               topk=512, seq=4096, batch=64, accum=8, streams="bfloat16", products="compute",
               router="bf16_6x", once=True, lr=8e-4, steps=50_000,
               vit=dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072,
                        projector_hidden=3072, slot_budget=24)),
    # 3B-class for one H200 (issue 28): MaxText ds4mini's width and expert scale (d 1536, 64
    # experts of 768, top-6) on the V4.1 plan at 12 layers, so the two are comparable.
    "m3": dict(d=1536, layers=12, heads=16, head_dim=128, experts=64, k=6, inter=768, vocab=65536,
               engram_rows=200_000, engram_heads=8, engram_dim=128, index_heads=16, index_dim=128,
               topk=512, seq=4096, batch=32, accum=8, streams="bfloat16", products="compute",
               router="bf16_6x", once=True, lr=8e-4, steps=50_000,
               vit=dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072,
                        projector_hidden=3072, slot_budget=24)),
}


def layout(layers: int) -> dict:
  """Flash's layer roles at depth `layers` (even): ratios, KV / index sources, Engram layers."""
  if layers % 2 or layers < 8:
    raise ValueError(f"layers ({layers}) must be even and at least 8")
  enc = layers // 2
  kv = tuple(range(2, enc, 6)) + (enc,)
  index = kv + tuple(range(enc + 4, layers, 4))
  engram_late = max(2, int(0.35 * layers))
  return dict(
      num_hidden_layers=layers,
      compress_ratios=(0, 0) + (2,) * (enc - 2) + (1,) * enc,
      kv_source_layer_ids=kv,
      index_source_layer_ids=index,
      candidate_source_layer_id=enc,
      engram_layer_ids=(1, engram_late),
  )


def model_fields(size: str) -> dict:
  if size not in SIZES:
    raise ValueError(f"unknown small size {size!r}; sizes are {sorted(SIZES)}")
  s = SIZES[size]
  d, h = s["d"], s["heads"]
  return dict(
      vocab_size=s["vocab"],
      hidden_size=d,
      num_attention_heads=h,
      head_dim=s["head_dim"],
      qk_rope_head_dim=64,
      q_lora_rank=d // 4,
      o_groups=h // 4,
      o_lora_rank=d // 4,
      sliding_window=128,
      index_n_heads=s["index_heads"],
      index_head_dim=s["index_dim"],
      index_topk=s["topk"],
      n_routed_experts=s["experts"],
      num_experts_per_tok=s["k"],
      moe_intermediate_size=s["inter"],
      engram_n_heads=s["engram_heads"],
      engram_head_dim=s["engram_dim"],
      engram_vocab_size=s["engram_rows"],
      engram_compressed_vocab_size=s["vocab"],
      seq_len=s["seq"],
      yarn_enabled=False,  # pre-training: plain RoPE (docs/design.md §4.5)
      # Exact `dropless`: on a Hopper GPU the Mosaic grouped GEMM; the s3 routed-experts layer
      # forward+backward measured 2.40 ms against capacity's 4.60 (benchmarks/RESULTS.md, issue 27).
      # `capacity` (factor below) stays a switch.
      moe_dispatch="dropless",
      moe_capacity_factor=1.25,
      # The LM loss from the head's input in chunks of 8192 tokens (loss.head_cross_entropy): no
      # float32 [B, T, V] logits for the whole micro-batch (m3 at 4 × 4096: 12 GiB of them).
      lm_loss_chunk=8192,
      # The mHC streams' storage dtype (docs/design.md §3.5): bfloat16 from s3 up, where it makes
      # the step 17 % shorter on one H200 (s3) and the s1 loss A/B over 4 seeds found no
      # difference (benchmarks/RESULTS.md); s1 and s2 keep float32, the A/B's reference arm.
      hc_stream_dtype=s["streams"],
      # The routed and shared experts' products ([a | u] and each down-projection) rounded once to
      # the compute dtype (docs/design.md §8.2): from s3 up, where the accumulated step is 2.4 %
      # (s3) and 2.6 % (m3) shorter on one H200 and the s1 loss A/B over 4 seeds found no
      # difference (benchmarks/RESULTS.md); s1 and s2 keep float32, the A/B's reference arm.
      moe_product_dtype=s["products"],
      # The router's float32 product as six bfloat16 tensor-core products (docs/design.md §8.2):
      # from s3 up, where it made the accumulated step 1.4 % shorter on one H200 and the s1 loss
      # A/B over 4 seeds found no difference (benchmarks/RESULTS.md); s1 and s2 keep "highest".
      router_precision=s["router"],
      # The matmul weights cast to the compute dtype once a step, the routed experts' w1 and w3 as
      # one pair (launch/step.py `cast_once`): from s3 up, with `train.unfilled_buffers` (below).
      cast_weights_once=s["once"],
      vision=dict(s["vit"]),
      **layout(s["layers"]),
  )


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  size = arg or "s1"
  s = SIZES.get(size)
  cfg = common.base_config(model=model_fields(size))
  cfg.data.seq_len = s["seq"]
  cfg.data.batch_size = s["batch"]
  cfg.train.grad_accum_steps = s["accum"]
  cfg.train.steps = s["steps"]
  # No zero fill of the scan stacks and switch residual slots (launch/unfilled_buffers.py): with
  # `cast_weights_once`, from s3 up (s1 and s2 keep both off: the A/B's reference arm).
  cfg.train.unfilled_buffers = s["once"]
  cfg.train.eval_every = 1000
  cfg.train.checkpoint_every = 1000
  cfg.train.log_every = 20
  cfg.optim.lr = s["lr"]
  cfg.optim.warmup_steps = max(100, s["steps"] // 50)
  cfg.optim.schedule_unit = "fraction"
  cfg.optim.decay_start = 0.7
  cfg.optim.decay_end = 1.0
  return cfg
