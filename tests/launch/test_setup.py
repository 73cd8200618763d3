"""launch/setup.py: typed config sections whose errors name the key, the batch check against the
mesh, and the abstract batch the adapter would make (issue 11 items 1-2)."""

import types

import jax
import numpy as np
import pytest

from configs import common, tiny
from launch import metrics as metrics_lib, setup


def _cfg(**overrides):
  cfg = tiny.get_config("micro")
  for key, value in overrides.items():
    section, name = key.split(".")
    cfg[section][name] = value
  return cfg


@pytest.mark.parametrize("key, value, words", [
    ("data.batch_size", 0, "config.data.batch_size=0 must be >= 1"),
    ("data.max_record_bytes", -1, "config.data.max_record_bytes=-1"),
    ("train.steps", 0, "config.train.steps=0 must be >= 1"),
    ("train.grad_accum_steps", 0, "config.train.grad_accum_steps=0 must be >= 1"),
    ("train.eval_every", -5, "config.train.eval_every=-5"),
    ("mesh.expert", 0, "config.mesh.expert=0"),
    ("optim.lr", -1.0, "config.optim: lr must be positive"),
    ("model.num_experts_per_tok", 9, "config.model: "),
])
def test_each_section_error_names_its_key(key, value, words):
  with pytest.raises(setup.SetupError) as e:
    setup.run_config(_cfg(**{key: value}), process_count=1)
  assert words in str(e.value)
  assert "tokens_per_step" not in str(e.value)


def test_run_config_sections_and_tokens_per_step():
  run = setup.run_config(_cfg(), process_count=2)
  assert run.optim.tokens_per_step == 2 * 8 * 32 == run.tokens_per_step
  assert run.train == common.TrainConfig(**dict(tiny.get_config("micro").train))
  assert run.mesh == common.MeshConfig()
  with pytest.raises(setup.SetupError, match="at most one axis"):
    setup.run_config(_cfg(**{"mesh.expert": -1}), process_count=1)


def test_global_batch_against_the_mesh():
  run = setup.run_config(_cfg(**{"mesh.data": 8}), process_count=1)
  mesh = setup.build_mesh(run.mesh)
  assert setup.global_batch(run, mesh, process_count=1) == 8
  run6 = setup.run_config(_cfg(**{"mesh.data": 8, "data.batch_size": 6}), process_count=1)
  with pytest.raises(setup.SetupError, match=r"data.batch_size \(6\).*multiple of 8"):
    setup.global_batch(run6, mesh, process_count=1)
  with pytest.raises(setup.SetupError, match="config.mesh"):
    setup.build_mesh(common.MeshConfig(data=3))


def test_abstract_batch_matches_the_adapter():
  """The abstract batch has the keys, shapes, dtypes and shardings of what the adapter makes
  from pipeline-shaped rows (tiny: vision and two Engram layers)."""
  from data import packing, pipeline
  cfg = tiny.get_config()
  cfg.data.batch_size = 8
  run = setup.run_config(cfg, process_count=1)
  mesh = setup.build_mesh(common.MeshConfig(data=8))
  row = packing.empty_row(run.data.seq_len, pipeline.max_images_per_row(run.data), 168)
  rows = packing.stack_rows([row] * 8)
  cmap = np.arange(run.model.vocab_size) % run.model.engram_compressed_vocab_size
  adapter = setup.BatchAdapter(run.model, run.data, mesh, cmap)
  real, abstract = adapter(rows), adapter.abstract(8)
  assert jax.tree.structure(real) == jax.tree.structure(abstract)
  for x, a in zip(jax.tree.leaves(real), jax.tree.leaves(abstract)):
    assert (x.shape, x.dtype) == (a.shape, a.dtype)
    assert x.sharding.is_equivalent_to(a.sharding, x.ndim)
  assert set(real["engram_ids"]) == set(run.model.engram_layer_ids)


def test_ahead_arguments_are_those_of_the_created_state():
  """`launch.train` compiles the train step from `ahead_args` while `init_state` creates the
  state: on an 8-device mesh (data 2 × fsdp 2 × expert 2) every leaf of (state, batch, schedule)
  has the shape, dtype, weak type and sharding the program was compiled for. A leaf of another
  dtype, shape or sharding, or another tree, is named by `signature_mismatch` (the run then
  compiles again for its own arguments)."""
  from data import pipeline
  from jax.sharding import NamedSharding, PartitionSpec as P
  run = setup.run_config(_cfg(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.expert": 2}),
                         process_count=1)
  mesh = setup.build_mesh(run.mesh)
  rows_n = setup.global_batch(run, mesh, process_count=1)
  tok = pipeline.make_tokenizer(run.data, run.model.vocab_size)
  cmap = setup.compression_map(run.model, tok)
  adapter = setup.BatchAdapter(run.model, run.data, mesh, cmap)
  ats, args, sched = setup.ahead_args(run, mesh, adapter, rows_n)
  ts = setup.init_state(run, mesh)
  it = pipeline.make_train_iterator(run.data, 0, 1, tokenizer=tok,
                                    token_features=setup.EngramFeatures(run.model, cmap))
  batch = adapter(next(it))   # the embedded corpus's first batch, as launch.train makes it
  real = (ts.state, batch, setup.schedule_input(run, ts))
  assert setup.signature_mismatch((*args, sched), real) is None
  assert any(len(set(s.spec) - {None}) for s in jax.tree.leaves(ts.shardings.params))

  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x.astype(np.float16) if "final_norm" in jax.tree_util.keystr(p) else x,
      ts.state.params)
  why = setup.signature_mismatch((*args, sched), (ts.state._replace(params=params), *real[1:]))
  assert "final_norm" in why and "float16" in why
  half = {**batch, "tokens": batch["tokens"][: rows_n // 2]}
  assert "['tokens']" in setup.signature_mismatch((*args, sched), (real[0], half, real[2]))
  moved = {**batch, "tokens": jax.device_put(batch["tokens"], NamedSharding(mesh, P()))}
  why = setup.signature_mismatch((*args, sched), (real[0], moved, real[2]))
  assert "['tokens']: sharding" in why
  assert "tree structure" in setup.signature_mismatch((*args, sched), real[:2])


def test_wandb_writer_only_when_asked(tmp_path, monkeypatch):
  """No project: no W&B. A project: the logged scalars go to wandb.log as well, under one run id
  per work directory. A project without the package: one MetricsError naming the setting."""
  calls = []
  fake = types.SimpleNamespace(
      init=lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(
          log=lambda d, step: calls.append(("log", step, d)),
          finish=lambda: calls.append(("finish",))))
  monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
  w = metrics_lib.MetricWriter(str(tmp_path / "a"), True)
  w.write(1, {"loss": 2.5})
  w.close()
  assert calls == []
  w = metrics_lib.MetricWriter(str(tmp_path / "b"), True, "proj", {"x": 1})
  w.write(3, {"loss": np.float32(2.5), "finite": np.bool_(True), "load": np.array([1.0, 2.0])})
  w.close()
  assert calls[0][0] == "init" and calls[0][1]["project"] == "proj"
  assert calls[1] == ("log", 3, {"loss": 2.5, "load/0": 1.0, "load/1": 2.0})
  assert calls[2] == ("finish",)
  monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import fails
  with pytest.raises(metrics_lib.MetricsError, match="train.wandb_project='proj'"):
    metrics_lib.MetricWriter(str(tmp_path / "c"), True, "proj")


def test_summary_reads_the_last_logged_figures(tmp_path):
  """A finished run started again reports the loss metrics.jsonl holds, not nan."""
  from launch import train
  w = metrics_lib.MetricWriter(str(tmp_path), True)
  w.write(4, {"loss": 3.25})
  w.write(4, {"eval/loss": 3.5, "eval/bits_per_byte": 1.25, "eval/tokens": 10.0})
  w.close()
  s = {"start_step": 4, "end_step": 4, "steps": 4, "losses": {}, "eval": {}, "seconds": 10.0,
       "compile_seconds": 0.0, "tokens_per_step": 256, "interrupted": None,
       "median_tokens_per_second": None, "mfu": None}
  text = train.format_summary(s, str(tmp_path))
  assert "nothing to train" in text and "last logged loss 3.2500 at step 4" in text
  assert "held-out     loss 3.5000, 1.2500 bits/byte" in text and "nan" not in text


def test_summary_counts_skipped_records_and_cut_documents(tmp_path):
  """Skipped records by reason and truncated documents, from the iterator's counters, in the
  end-of-run summary (issue 33: they were only in metrics.jsonl); no line when there are none."""
  from launch import train
  counters = {"skipped/malformed_json": 2, "skipped/invalid_utf8": 1, "truncated_documents": 1,
              "rows": 8, "documents/text": 5}
  s = {"start_step": 0, "end_step": 2, "steps": 2, "losses": {1: 3.0, 2: 2.5}, "eval": {},
       "seconds": 10.0, "compile_seconds": 4.0, "tokens_per_step": 256, "interrupted": None,
       "median_tokens_per_second": 100.0, "mfu": None, "data": counters}
  text = train.format_summary(s, str(tmp_path))
  assert ("  data         skipped 3 records (invalid_utf8 1, malformed_json 2), 1 document cut at "
          "data.max_document_tokens (python -m launch.data_report lists where)") in text
  assert "MFU" not in text  # CPU: no peak, and no advice to set one
  assert "data  " not in train.format_summary(dict(s, data={"rows": 8}), str(tmp_path))


def test_micro_batches_must_split_the_batch_and_the_mesh():
  """8 rows on 4 devices: 2 micro-batches of 4 rows split; 4 micro-batches of 2 rows do not, and
  the one-line error names both numbers and what would divide."""
  ok = setup.run_config(_cfg(**{"mesh.data": 4, "train.grad_accum_steps": 2}), process_count=1)
  mesh = setup.build_mesh(ok.mesh, jax.devices()[:4])
  assert setup.global_batch(ok, mesh, process_count=1) == 8
  bad = setup.run_config(_cfg(**{"mesh.data": 4, "train.grad_accum_steps": 4}), process_count=1)
  with pytest.raises(setup.SetupError) as e:
    setup.global_batch(bad, mesh, process_count=1)
  msg = str(e.value)
  assert "\n" not in msg
  assert "= 8 rows" in msg and "train.grad_accum_steps (4)" in msg and "(4 ways)" in msg
  assert "multiple of 16" in msg and "grad_accum_steps one of [1, 2]" in msg


def test_memory_shortfall_names_what_is_needed_and_the_micro_batch_that_fits():
  """A compiled train step over the device's memory (XLA's memory analysis: arguments + outputs −
  donated + temporaries) gives one line with both figures and the smallest grad_accum_steps whose
  scaled temporaries (+ a float32 gradient accumulator) fit; none when nothing fits; no message
  when it fits or the device's memory is unknown (the CPU)."""
  G = 2.0 ** 30
  analysis = lambda temp: types.SimpleNamespace(
      memory_analysis=lambda: types.SimpleNamespace(
          argument_size_in_bytes=10 * G, output_size_in_bytes=9 * G, alias_size_in_bytes=8 * G,
          temp_size_in_bytes=temp))
  run = setup.run_config(_cfg(**{"data.batch_size": 32}), process_count=1)
  mesh = setup.build_mesh(run.mesh, jax.devices()[:1])
  assert setup.device_memory(mesh) is None                          # the CPU does not say
  short = lambda temp, device: setup.memory_shortfall(analysis(temp), run, mesh, 32, 2 * G, device)
  assert short(100 * G, None) is None
  assert short(29 * G, 40 * G) is None                              # 11 + 29 = 40 GiB: fits
  msg = short(100 * G, 40 * G)                                      # 111 GiB
  assert "\n" not in msg
  assert "needs 111.0 GiB a device" in msg and "the 40.0 GiB the device gives it" in msg
  assert "temporaries 100.0 GiB" in msg and "32 rows a micro-batch per device" in msg
  # k = 2: 11 + 50 + 2 = 63; k = 4: 11 + 25 + 2 = 38 <= 40.
  assert "train.grad_accum_steps=4 (8 rows a micro-batch per device" in msg and "~38.0 GiB" in msg
  assert "train.memory_check=False" in msg
  assert "not even one row" in short(100 * G, 12 * G)               # 11 + 100/32 + 2 > 12


def test_plan_shortfall_stops_before_compiling_with_the_micro_batch_the_plan_fits():
  """The analytic memory plan over the device's memory by more than its own error
  (PLAN_OVER_ESTIMATE) gives one line before anything compiles: its estimate, the device's, and
  the smallest grad_accum_steps whose plan fits (those figures are the plan's own, recomputed
  here); nothing within that error or when the device's memory is unknown."""
  from launch import memory_plan
  run = setup.run_config(_cfg(**{"data.batch_size": 32}), process_count=1)
  mesh = setup.build_mesh(run.mesh, jax.devices()[:1])
  plan = lambda k: memory_plan.analytic_plan(                              # noqa: E731
      run.model, dict(mesh.shape), 32, run.data.seq_len, chain=run.optim.chain,
      grad_accum_steps=k, backend="cpu")["total_bytes"]
  over = setup.PLAN_OVER_ESTIMATE
  assert setup.plan_shortfall(run, mesh, 32, None) is None
  assert setup.plan_shortfall(run, mesh, 32, plan(1)) is None
  assert setup.plan_shortfall(run, mesh, 32, plan(1) / over) is None      # within the estimate's error
  assert setup.plan_shortfall(run, mesh, 32, plan(1) / over * 0.999) is not None
  device = (plan(4) + plan(2)) / 2          # between: 2 micro-batches do not fit, 4 do
  assert plan(2) > device >= plan(4) and plan(1) > over * device
  msg = setup.plan_shortfall(run, mesh, 32, device)
  assert "\n" not in msg
  gib = lambda b: (f"{b / 2**30:.1f} GiB" if b >= 2**30              # noqa: E731
                   else f"{b / 2**20:.1f} MiB")
  assert f"estimates the train step at {gib(plan(1))} a device (32 rows" in msg
  assert f"more than the {gib(device)} the device gives it" in msg
  assert (f"train.grad_accum_steps=4 (8 rows a micro-batch per device, the same 32-row step) is "
          f"estimated at {gib(plan(4))}") in msg
  assert "--analytic --backend=cpu" in msg and "train.memory_check=False" in msg
  assert "no micro-batch of whole rows" in setup.plan_shortfall(run, mesh, 32, plan(32) / 2)


def test_phases_compile_in_order_and_the_first_is_awaited_alone():
  """`in_order`: one worker compiles the phases one after another in the order given, and
  `wait(only=...)` returns the first phase's program while the next is still compiling (the run
  trains its first phase meanwhile)."""
  import threading
  import time
  events, release = [], threading.Event()

  class Lowered:
    def __init__(self, tv):
      self.tv = tv

    def compile(self):
      events.append(f"start {self.tv}")
      if self.tv:                   # the later phase: held until the test lets it finish
        assert release.wait(30)
      else:
        time.sleep(0.3)             # two workers would start the later phase meanwhile
      events.append(f"end {self.tv}")
      return f"program {self.tv}"

  jitted = types.SimpleNamespace(lower=lambda *args: Lowered(args[-1]))
  mesh = setup.build_mesh(setup.run_config(_cfg(), process_count=1).mesh, jax.devices()[:1])
  c = setup.start_train_steps(jitted, mesh, [False, True], ("state", "batch"), in_order=True)
  assert c.holds(False) and c.holds(True)
  assert c.wait(only=(False,)) == {False: "program False"}
  assert "end True" not in events   # the later phase still compiling
  release.set()
  assert c.wait(only=(True,)) == {True: "program True"}
  assert events == ["start False", "end False", "start True", "end True"]   # one after another
