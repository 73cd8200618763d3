"""dsv41_jax/layer_plan.py (docs/design.md §2): each layer's role and the runs the scan executes."""

import numpy as np
import pytest

from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.layer_plan import build_layer_plan


def test_flash_plan_matches_model_md_section_2():
  plan = build_layer_plan(ModelConfig())
  modes = [l.mode for l in plan]
  assert modes[:2] == ["swa", "swa"]
  assert [l.index for l in plan if l.mode == "full"] == [2, 8, 14, 20]
  assert [l.index for l in plan if l.mode == "reindex"] == [24, 28, 32, 36]
  assert all(plan[i].kv_source == 20 for i in range(20, 40))
  assert [plan[i].index_source for i in (21, 25, 39)] == [20, 24, 36]
  assert [plan[i].kv_source for i in (3, 9, 19)] == [2, 8, 14]
  assert [l.index for l in plan if l.engram] == [1, 14]
  assert all(l.is_encoder == (l.index < 20) for l in plan)
  # Runs split at the halves, at ratio changes and before each Engram layer: 5 runs for 40
  # layers (3 scanned, 2 of one layer unrolled), each switching over the kinds it holds; an
  # Engram run injects before its first layer.
  runs = [(r.first_layer, r.n_layers, tuple(k.kind_name for k in r.kinds), r.engram_layer)
          for r in plan.runs]
  assert runs == [(0, 1, ("swa",), None), (1, 1, ("swa",), 1), (2, 12, ("full", "reuse"), None),
                  (14, 6, ("full", "reuse"), 14), (20, 20, ("full", "reuse", "reindex"), None)]
  assert [l.index for r in plan.runs for l in r.layers] == list(range(40))


# --- random plans against docs/design.md §2 restated ------------------------------------------


def _random_layout(rng):
  """A random depth, ratio blocks per half, Full / Reindex / Engram layers and KV input: about half
  of them plans that cannot work (a CSA2 layer with no Full layer before it at its ratio and in
  its half)."""
  n = 2 * int(rng.integers(1, 7))
  ratios = []
  for _ in range(2):
    cuts = sorted(rng.choice(np.arange(1, n // 2 + 1), int(rng.integers(0, 3)), replace=True))
    blocks = np.split(np.arange(n // 2), cuts)
    ratios += [int(m) for b in blocks for m in [rng.choice([0, 1, 2, 4])] * len(b)]
  csa = [i for i, m in enumerate(ratios) if m]
  pick = lambda ids, p: tuple(int(i) for i in ids if rng.random() < p)
  kv_ids = pick(csa, 0.4)
  if rng.random() < 0.6:   # mostly workable: each ratio block of each half opens with a Full layer
    kv_ids = tuple(sorted(set(kv_ids) | {i for i in csa if i == 0 or ratios[i - 1] != ratios[i]
                                         or i == n // 2}))
  idx_ids = tuple(sorted(set(kv_ids) | set(pick(csa, 0.3))))
  pool = bool(idx_ids) and rng.random() < 0.5
  return dict(num_hidden_layers=n, compress_ratios=tuple(ratios), kv_source_layer_ids=kv_ids,
              index_source_layer_ids=idx_ids, engram_layer_ids=pick(range(n), 0.3),
              kv_source_input=str(rng.choice(["own", "encoder_final"])),
              use_candidate_pool=pool,
              candidate_source_layer_id=int(rng.choice(idx_ids)) if pool else 20,
              yarn_enabled=bool(rng.random() < 0.5))


def _np_plan(c: dict) -> list[dict] | str:
  """§2 (and §5.6 for the candidate roles, §6 for the KV input) layer by layer; the reason when
  the plan cannot work."""
  n, ratios = c["num_hidden_layers"], c["compress_ratios"]
  half = lambda i: i < n // 2
  layers = []
  for i, m in enumerate(ratios):
    mode = ("swa" if m == 0 else "full" if i in c["kv_source_layer_ids"]
            else "reindex" if i in c["index_source_layer_ids"] else "reuse")
    full = [j for j in range(i + 1) if ratios[j] and j in c["kv_source_layer_ids"]]
    pub = [j for j in range(i + 1) if ratios[j] and j in c["index_source_layer_ids"]]
    kv = None if mode == "swa" else (full[-1] if full else None)
    if mode != "swa" and (kv is None or ratios[kv] != m or half(kv) != half(i)):
      return f"layer {i}"
    layers.append(dict(
        mode=mode, kv_source=kv, index_source=None if mode == "swa" else pub[-1],
        engram=i in c["engram_layer_ids"], is_encoder=half(i),
        kv_input=(None if mode != "full" else "encoder_final"
                  if c["kv_source_input"] == "encoder_final" and not half(i) else "own"),
        # §6: CED prefill projects a decoder Full layer's KV from H_{L/2} when the layer reads
        # it, or when it is the first decoder layer (its input is H_{L/2})
        prefills_from_encoder=mode == "full" and not half(i) and (
            c["kv_source_input"] == "encoder_final" or i == n // 2),
        yarn=c["yarn_enabled"] and m != 0))
  if c["use_candidate_pool"]:
    src = c["candidate_source_layer_id"]
    for i, l in enumerate(layers):
      if i == src and l["mode"] != "swa":
        l["candidate_role"] = "source"
      elif l["mode"] == "reindex" and i > src and l["kv_source"] == layers[src]["kv_source"]:
        l["candidate_role"] = "consumer"
  return layers


def test_random_plans_match_the_rules_of_section_2():
  """200 random layouts: every LayerSpec field against the restated rules, unworkable plans
  rejected naming the layer, and the runs as §2 defines them: consecutive layers of one half and
  one ratio, an Engram layer only first, a new run only where one of those forces it; each
  run's kinds the distinct (mode, candidate role, KV input) in order of first appearance, each
  layer's slot its rank among the run's layers of its kind."""
  rng = np.random.default_rng(12)
  base = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, head_dim=16,
              qk_rope_head_dim=8, q_lora_rank=8, o_groups=1, o_lora_rank=8, sliding_window=8,
              index_n_heads=1, index_head_dim=16, index_topk=4, seq_len=64)
  rejected = 0
  for _ in range(200):
    c = _random_layout(rng)
    want = _np_plan(c)
    if isinstance(want, str):
      with pytest.raises(ConfigError, match=want + r"\b"):
        ModelConfig(**base, **c)
      rejected += 1
      continue
    cfg = ModelConfig(**base, **c)
    plan = build_layer_plan(cfg)
    n = c["num_hidden_layers"]
    assert [l.index for l in plan] == list(range(n)) and plan.num_encoder_layers == n // 2
    for spec, w in zip(plan, want):
      got = dict(mode=spec.mode, kv_source=spec.kv_source, index_source=spec.index_source,
                 engram=spec.engram, is_encoder=spec.is_encoder, kv_input=spec.kv_input,
                 prefills_from_encoder=spec.prefills_from_encoder, yarn=spec.yarn)
      assert got == {k: v for k, v in w.items() if k != "candidate_role"}, (c, spec.index)
      assert spec.candidate_role == w.get("candidate_role"), (c, spec.index)
      assert spec.compress_ratio == c["compress_ratios"][spec.index]
      assert spec.rope_theta == (cfg.rope_theta if spec.compress_ratio == 0
                                 else cfg.compress_rope_theta)
      assert (spec.owns_compressor, spec.owns_indexer, spec.reads_global_kv) == (
          spec.mode == "full", spec.mode in ("full", "reindex"), spec.mode != "swa")

    runs = [[l.index for l in r.layers] for r in plan.runs]
    assert sum(runs, []) == list(range(n))
    key = lambda i: (plan[i].is_encoder, plan[i].compress_ratio)
    for r, run in zip(runs, plan.runs):
      assert len({key(i) for i in r}) == 1 and not any(plan[i].engram for i in r[1:])
      assert run.engram_layer == (r[0] if plan[r[0]].engram else None)
      kinds = list(dict.fromkeys(plan[i].kind for i in r))
      assert [k.kind for k in run.kinds] == kinds
      assert list(run.kind_of) == [kinds.index(plan[i].kind) for i in r]
      assert list(run.slot_of) == [[plan[j].kind for j in r[:p]].count(plan[i].kind)
                                   for p, i in enumerate(r)]
      for p, i in enumerate(r):
        assert plan.run_of(i) == (plan.runs.index(run), p)
    for prev, nxt in zip(runs, runs[1:]):   # each cut is forced
      assert key(prev[-1]) != key(nxt[0]) or plan[nxt[0]].engram
  assert 40 < rejected < 160


def test_entries_are_the_compressor_blocks_a_layer_reads():
  """`LayerSpec.entries(T)`: ⌈T / m⌉ compressed entries for a layer that reads the global KV (the
  compressor's zero-padded blocks), 0 for a sliding-window layer; checked against the compressor's
  own output length on Flash's plan."""
  import jax.numpy as jnp
  from dsv41_jax.layers.compressor import _group
  plan = build_layer_plan(ModelConfig())
  for T in (1, 2, 3, 127, 128, 129, 4096, 4097):
    for spec in plan:
      if spec.mode == "swa":
        assert spec.entries(T) == 0
      else:
        m = spec.compress_ratio
        want = _group(jnp.zeros((1, T, 1)), m).shape[1]
        assert spec.entries(T) == want == int(np.ceil(T / m)), (spec.index, T)
