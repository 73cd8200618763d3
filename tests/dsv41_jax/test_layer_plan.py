"""dsv41_jax/layer_plan.py (docs/design.md §2): each layer's role and the runs the scan executes."""

from dsv41_jax.config import ModelConfig
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
  # Runs split at the halves and at ratio changes: 3 scanned runs for 40 layers, each switching
  # over the kinds it holds and injecting its one Engram layer.
  runs = [(r.first_layer, r.n_layers, tuple(k.kind_name for k in r.kinds), r.engram_layer)
          for r in plan.runs]
  assert runs == [(0, 2, ("swa",), 1), (2, 18, ("full", "reuse"), 14),
                  (20, 20, ("full", "reuse", "reindex"), None)]
  assert [l.index for r in plan.runs for l in r.layers] == list(range(40))
