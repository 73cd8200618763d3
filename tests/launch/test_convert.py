"""launch.convert: work directory ↔ the released DeepSeek-V4.1 layout (issue 30, docs/checkpoints.md).

* export then import is the identity on values the released formats hold (tiny and an s1-like
  config with the candidate pool): a second round trip is bit-identical, and the first one's values
  equal an independent numpy / ml_dtypes quantizer of the original;
* a checkpoint the test writes itself from random stored bytes (E4M3 + E8M0 tiles, packed E2M1,
  FP8 table rows, bf16, float32; a scale in another shard than its weight; dropped mtp./vision.
  tensors) imports to the arrays decoded here in float64, at hand-written places;
* the imported model's logits equal the original's, read through launch.generate.load_model;
* the Flash map, from shapes alone, covers every released tensor and every parameter of the ledger;
* bad input is refused before any write, or leaves nothing behind; launch.train starts from an
  import with a fresh optimizer state;
* an import's stored chunks (what an export reads at a time) are blocks within the budget, split by
  layer and expert, never one chunk per table row.
"""

from __future__ import annotations

import json
import logging
import os
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from configs import common, flash, small, tiny
from dsv41_jax import model as model_lib
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.ledger import ledger
from dsv41_jax.param_paths import iter_params
from launch import checkpoint as ckpt_lib
from launch import convert, released_config, released_layout as rl


def tiny_cfg():
  cfg = tiny.get_config()
  cfg.model.vision = None
  return cfg


def s1_like_cfg():
  """s1's layer plan (12 layers: kv sources 2, 6; index 2, 6, 10; Engram 1, 4) at small widths, candidate pool on."""
  fields = small.model_fields("s1")
  fields.update(vision=None, hidden_size=64, num_attention_heads=4, head_dim=64, q_lora_rank=32,
                o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=64, index_topk=16,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                vocab_size=512, engram_compressed_vocab_size=512, engram_vocab_size=211,
                engram_n_heads=2, engram_head_dim=32, seq_len=128, use_candidate_pool=True,
                candidate_topk_blocks=4, candidate_block_size=2, dtype="float32")
  return common.base_config(model=fields)


def abstract(cfg):
  mcfg = common.model_config(cfg)
  graphdef, state = nnx.split(model_lib.abstract_model(mcfg))
  return mcfg, graphdef, nnx.as_pure(state)


def random_workdir(path, cfg, seed=0, step=3):
  """A work directory holding random parameters and MoE biases (no optimizer state)."""
  mcfg, _, pure = abstract(cfg)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.05).astype(s.dtype), pure)
  bias = rng.normal(size=(mcfg.num_hidden_layers, 2, mcfg.n_routed_experts)).astype(np.float32)
  os.makedirs(path)
  convert.save_weights(path, step, params, bias)
  ckpt_lib.write_config(path, cfg.to_dict())
  return params, bias


def weights(workdir, cfg):
  """{leaf path: array} of a work directory's newest checkpoint (params and MOE_BIAS)."""
  mcfg, _, pure = abstract(cfg)
  leaves = dict(iter_params(pure))
  leaves[rl.MOE_BIAS] = ()
  steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())
  reader = convert.LeafReader(os.path.join(workdir, "checkpoints", str(steps[-1]), "state"))
  return {path: reader.read(path, ()) for path in leaves}


def flat(params, bias):
  out = {p: np.asarray(x) for p, x in iter_params_values(params)}
  out[rl.MOE_BIAS] = np.asarray(bias)
  return out


def iter_params_values(tree):
  from dsv41_jax.param_paths import path_str
  for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    yield path_str(p), x


# --- an independent reference of the released formats ---------------------------------------------

def ref_grid(x, storage):
  """Decoded values of x in the release's storage, computed with float64 numpy and ml_dtypes casts
  (not with dsv41_jax.quant)."""
  x = np.asarray(x, np.float64)
  if storage == "f32":
    return x.astype(np.float32)
  if storage == "bf16":
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
  if storage == "fp4":
    b = x.reshape(x.shape[0], -1, 32)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0 ** -126) / 6))
    q = (b / scale).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (q * scale).reshape(x.shape).astype(np.float32)
  br, bc = (1, 32) if storage == "fp8_rows" else (32, 32)
  R, C = x.shape
  pr, pc = -(-R // br) * br, -(-C // bc) * bc
  p = np.zeros((pr, pc))
  p[:R, :C] = x
  t = p.reshape(pr // br, br, pc // bc, bc)
  amax = np.abs(t).max(axis=(1, 3), keepdims=True)
  scale = 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-4) / 448))
  q = (t / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return (q * scale).reshape(pr, pc)[:R, :C].astype(np.float32)


def on_grid(cfg, values):
  """The parameters a release of `values` holds: every released tensor through `ref_grid`, Engram
  padding rows zero."""
  mcfg = common.model_config(cfg)
  out = {k: np.zeros_like(v) if k.endswith("engram/table") else np.array(v)
         for k, v in values.items()}
  for t in rl.released_tensors(mcfg):
    pl = t.placement
    y = ref_grid(rl.to_released(values[pl.path][pl.index], pl.transform, t.shape), t.storage)
    out[pl.path][pl.index] = rl.from_released(y, pl.transform, out[pl.path][pl.index].shape)
  return out


def bits(a):
  a = np.asarray(a)
  return a.view(np.uint32) if a.dtype == np.float32 else a


@pytest.mark.parametrize("make_cfg", [tiny_cfg, s1_like_cfg], ids=["tiny", "s1_like"])
def test_export_import_is_the_identity_on_grid(tmp_path, make_cfg, monkeypatch):
  monkeypatch.setattr(convert, "ROW_BLOCK", 1000)   # Engram tables in several blocks of rows
  cfg = make_cfg()
  params, bias = random_workdir(tmp_path / "run", cfg)
  first = convert.export_checkpoint(str(tmp_path / "run"), str(tmp_path / "rel1"))
  assert first["step"] == 3 and first["dropped"] == []
  convert.import_checkpoint(cfg, str(tmp_path / "rel1"), str(tmp_path / "wd1"))
  convert.export_checkpoint(str(tmp_path / "wd1"), str(tmp_path / "rel2"))
  convert.import_checkpoint(cfg, str(tmp_path / "rel2"), str(tmp_path / "wd2"))
  one, two = weights(tmp_path / "wd1", cfg), weights(tmp_path / "wd2", cfg)
  expected = on_grid(cfg, flat(params, bias))
  assert set(one) == set(two) == set(expected)
  for path in expected:
    assert np.array_equal(bits(two[path]), bits(one[path])), path      # bit for bit
    assert np.array_equal(bits(one[path]), bits(expected[path])), path  # the reference quantizer
  assert json.load(open(tmp_path / "wd1" / ckpt_lib.IMPORTED))["step"] == 0


# --- a release written by the test ----------------------------------------------------------------

def write_safetensors(path, tensors):
  """The file format by hand (8-byte length, JSON header, bytes): independent of launch.safetensors."""
  names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
           np.dtype(np.int8): "I8", np.dtype(np.uint8): "F8_E8M0",
           np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
  header, offset, body = {}, 0, b""
  for name, a in tensors.items():
    raw = np.ascontiguousarray(a).tobytes()
    header[name] = {"dtype": names[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + len(raw)]}
    offset += len(raw)
    body += raw
  head = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head + body)


FP4_VALUES = np.asarray([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def synthetic_release(directory, cfg, seed=0):
  """Random stored bytes in the released layout; returns {name: float64 decoded values}."""
  mcfg = common.model_config(cfg)
  rng = np.random.default_rng(seed)
  shards, expected = [{}, {}], {}
  finite_e4m3 = np.asarray([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
  for n, t in enumerate(rl.released_tensors(mcfg)):
    R, C = t.shape[0], t.shape[-1]
    home = shards[n % 2]
    if t.storage in ("bf16", "f32"):
      v = rng.normal(size=t.shape).astype(np.float32)
      v = v.astype(ml_dtypes.bfloat16) if t.storage == "bf16" else v
      home[t.name] = v
      expected[t.name] = v.astype(np.float64)
      continue
    if t.storage == "fp4":
      codes = rng.integers(0, 16, size=(R, C), dtype=np.uint8)
      e = rng.integers(110, 135, size=(R, C // 32), dtype=np.uint8)
      home[t.name] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8)
      expected[t.name] = FP4_VALUES[codes] * np.repeat(2.0 ** (e.astype(np.float64) - 127), 32, 1)
    else:
      br, bc = (1, 32) if t.storage == "fp8_rows" else (32, 32)
      q = rng.choice(finite_e4m3, size=(R, C)).view(ml_dtypes.float8_e4m3fn)
      e = rng.integers(110, 135, size=(-(-R // br), -(-C // bc)), dtype=np.uint8)
      home[t.name] = q
      full = np.repeat(np.repeat(2.0 ** (e.astype(np.float64) - 127), br, 0), bc, 1)[:R, :C]
      expected[t.name] = q.astype(np.float64) * full
    shards[(n + 1) % 2][t.scale_name] = e   # the scale in the other shard
  shards[0]["mtp.0.attn.wq_a.weight"] = np.zeros((4, 4), np.float32)
  shards[1]["vision.blocks.0.attn.wqkv.weight"] = np.zeros((4, 4), ml_dtypes.bfloat16)
  os.makedirs(directory)
  names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  weight_map = {}
  for name, tensors in zip(names, shards):
    write_safetensors(os.path.join(directory, name), tensors)
    weight_map.update(dict.fromkeys(tensors, name))
  with open(os.path.join(directory, convert.INDEX), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  config = released_config.config_json(mcfg)
  config["text_config"].update(num_nextn_predict_layers=1, dspark_block_size=5)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  return expected


def test_a_release_written_here_imports_to_the_expected_arrays(tmp_path):
  cfg = s1_like_cfg()
  mcfg = common.model_config(cfg)
  want = synthetic_release(str(tmp_path / "rel"), cfg)
  summary = convert.import_checkpoint(cfg, str(tmp_path / "rel"), str(tmp_path / "wd"))
  assert summary["dropped"] == 2 and summary["dropped_prefixes"] == ["mtp", "vision"]
  got = weights(tmp_path / "wd", cfg)
  plan = build_layer_plan(mcfg)
  H, D, G, R, Q = (mcfg.num_attention_heads, mcfg.head_dim, mcfg.o_groups, mcfg.o_lora_rank,
                   mcfg.q_lora_rank)
  close = lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float64), b)
  close(got["embed"], want["embed.weight"])
  close(got["head"], want["head.weight"].T)
  for L in (0, 2, 6, 7, 10, 11):
    r, i = plan.run_of(L)
    core = f"runs/{r}/core"
    close(got[f"{core}/attn/wq_b"][i], want[f"layers.{L}.attn.wq_b.weight"].T.reshape(Q, H, D))
    for g in range(G):
      close(got[f"{core}/attn/wo_a"][i, g], want[f"layers.{L}.attn.wo_a.weight"][g * R:(g + 1) * R].T)
    close(got[f"{core}/attn_hc/fn"][i], want[f"layers.{L}.hc_attn_fn"])
    close(got[f"{core}/moe/experts/w2"][i, 3], want[f"layers.{L}.ffn.experts.3.w2.weight"].T)
    close(got[f"{core}/moe/shared/w1"][i], want[f"layers.{L}.ffn.shared_experts.w1.weight"].T)
    close(got[rl.MOE_BIAS][L, 1], want[f"layers.{L}.ffn.gate.bias_vl"])
    spec = plan[L]
    if spec.owns_indexer:   # 2: Full at ratio 2 (gate), 6: Full + candidate source, 10: Reindex
      pub = f"runs/{r}/{spec.kind_name}"
      slot = plan.runs[r].slot_of[i]
      close(got[f"{pub}/indexer/weights_proj"][slot],
            want[f"layers.{L}.attn.indexer.weights_proj.weight"].T)
      if spec.compress_ratio == 2:
        close(got[f"{pub}/compressor/wgate"][slot], want[f"layers.{L}.attn.compressor.wgate.weight"].T)
  assert {plan[L].kind_name for L in (6, 10)} == {"full_source", "reindex_consumer"}
  for L in mcfg.engram_layer_ids:
    r, _ = plan.run_of(L)
    table, rows = got[f"runs/{r}/engram/table"], want[f"layers.{L}.engram.embed.weight"]
    close(table[:len(rows)], rows)
    assert not table[len(rows):].any() and len(table) > len(rows)
    close(got[f"runs/{r}/engram/w_ekv"], want[f"layers.{L}.engram.wkv.weight"].T)


def micro_cfg(tmp_path):
  cfg = tiny.get_config("micro")
  cfg.model.moe_intermediate_size = 32   # FP4 experts: input widths in blocks of 32
  cfg.data.cache_dir = str(tmp_path / "cache")
  return cfg


def test_imported_logits_equal_the_originals(tmp_path):
  """micro model: the on-grid original and its export → import, read by launch.generate."""
  from launch.generate import load_model
  cfg = micro_cfg(tmp_path)
  params, bias = random_workdir(tmp_path / "run", cfg)
  convert.export_checkpoint(str(tmp_path / "run"), str(tmp_path / "rel"))
  convert.import_checkpoint(cfg, str(tmp_path / "rel"), str(tmp_path / "wd"))
  loaded = load_model(str(tmp_path / "wd"))
  assert loaded.step == 0
  mcfg, graphdef, pure = abstract(cfg)
  grid = on_grid(cfg, flat(params, bias))
  from dsv41_jax.param_paths import path_str
  original = jax.tree_util.tree_map_with_path(lambda p, _: grid[path_str(p)], pure)
  rng = np.random.default_rng(1)
  T = mcfg.seq_len
  tokens = rng.integers(0, mcfg.vocab_size, size=(2, T)).astype(np.int32)
  batch = dict(tokens=tokens, positions=np.broadcast_to(np.arange(T, dtype=np.int32), (2, T)),
               segment_ids=np.ones((2, T), np.int32))
  from dsv41_jax import inputs
  batch["engram_ids"] = inputs.engram_ids(mcfg, tokens, batch["segment_ids"], None,
                                          loaded.compression_map)
  forward = jax.jit(lambda p, b, x: nnx.merge(graphdef, p)(x, b)[0])
  mine = forward(original, grid[rl.MOE_BIAS], batch)
  theirs = forward(nnx.as_pure(nnx.state(loaded.model)), loaded.moe_bias, batch)
  assert np.array_equal(bits(mine), bits(theirs))
  assert np.isfinite(np.asarray(mine)).all()


# --- the Flash map, from shapes ------------------------------------------------------------------

def port_names(tc):
  """The released tensor names by the ports' rule (DeepSeek's layout as the vLLM/ATOM, torchtitan
  and mlx-lm loaders read it), written from the text_config alone."""
  names = {"embed.weight", "norm.weight", "head.weight"}
  kv, idx, eng = (set(tc["kv_source_layer_ids"]), set(tc["index_source_layer_ids"]),
                  set(tc["engram_layer_ids"]))
  for L in range(tc["num_hidden_layers"]):
    p = f"layers.{L}"
    names |= {f"{p}.attn_norm.weight", f"{p}.ffn_norm.weight", f"{p}.attn.attn_sink",
              f"{p}.attn.q_norm.weight", f"{p}.attn.kv_norm.weight", f"{p}.ffn.gate.weight",
              f"{p}.ffn.gate.bias", f"{p}.ffn.gate.bias_vl"}
    names |= {f"{p}.hc_{s}_{k}" for s in ("attn", "ffn") for k in ("fn", "base", "scale")}
    names |= {f"{p}.attn.{w}.weight" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
    names |= {f"{p}.ffn.shared_experts.w{j}.weight" for j in (1, 2, 3)}
    names |= {f"{p}.ffn.experts.{e}.w{j}.weight" for e in range(tc["n_routed_experts"])
              for j in (1, 2, 3)}
    if L in kv:
      names |= {f"{p}.attn.compressor.wkv.weight", f"{p}.attn.compressor.norm.weight",
                f"{p}.attn.indexer.wk.weight", f"{p}.attn.indexer.k_norm.weight"}
      if tc["compress_ratios"][L] > 1:
        names.add(f"{p}.attn.compressor.wgate.weight")
    if L in idx:
      names |= {f"{p}.attn.indexer.wq_b.weight", f"{p}.attn.indexer.weights_proj.weight"}
    if L in eng:
      names |= {f"{p}.engram.{w}" for w in ("embed.weight", "wkv.weight", "q_weight", "k_weight")}
  return names


def test_the_flash_map_covers_the_release_and_the_ledger():
  mcfg = common.model_config(flash.get_config("long"))
  tc = released_config.text_config(mcfg)
  assert tc["engram_num_embeddings"] == [384006168, 384016682]   # the released config's values
  tensors = rl.released_tensors(mcfg)
  assert {t.name for t in tensors} == port_names(tc) and len(tensors) == len(port_names(tc))
  shapes = {t.name: t.shape for t in tensors}
  assert shapes["layers.20.attn.wq_b.weight"] == (64 * 512, 1280)
  assert shapes["layers.20.attn.wo_a.weight"] == (8 * 1024, 64 * 512 // 8)
  assert shapes["layers.36.attn.indexer.wq_b.weight"] == (32 * 128, 1280)
  assert shapes["layers.14.engram.wkv.weight"] == (5 * 5120, 3 * 8 * 256)
  assert shapes["layers.1.engram.embed.weight"] == (384006168, 256)
  assert shapes["layers.39.ffn.experts.383.w2.weight"] == (5120, 2304)
  _, _, pure = abstract(flash.get_config("long"))
  leaves = dict(iter_params(pure))
  leaves[rl.MOE_BIAS] = (40, 2, 384)
  assert rl.check_coverage(mcfg, leaves, tensors) == []
  # Every parameter of the ledger is in the release once, but the ViT and the table padding.
  figures = ledger(mcfg)
  padding = sum(int(np.prod(s)) for p, s in leaves.items() if p.endswith("engram/table")) - sum(
      int(np.prod(shapes[f"layers.{L}.engram.embed.weight"])) for L in mcfg.engram_layer_ids)
  released = sum(int(np.prod(t.shape)) for t in tensors if t.placement.path != rl.MOE_BIAS)
  assert released == figures["total_params"] - figures["vision_params"] - padding


# --- bad input ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def release(tmp_path_factory):
  root = tmp_path_factory.mktemp("release")
  random_workdir(root / "run", tiny_cfg())
  convert.export_checkpoint(str(root / "run"), str(root / "rel"))
  return root / "rel"


def copy_release(release, to):
  import shutil
  shutil.copytree(release, to)
  return to


def shard_of(directory):
  return os.path.join(directory, "model-00001-of-00001.safetensors")


def assert_nothing_written(tmp_path, name="wd"):
  assert not [n for n in os.listdir(tmp_path) if n.startswith(name)]


def test_a_tensor_of_another_shape_is_refused_before_any_write(tmp_path, release):
  rel = copy_release(release, tmp_path / "rel")
  from launch import safetensors as st
  infos = st.read_header(shard_of(rel))
  tensors = {n: np.array(st.read_tensor(i)) for n, i in infos.items()}
  tensors["layers.3.attn.wkv.weight"] = tensors["layers.3.attn.wkv.weight"][:16]
  st.write_file(shard_of(rel), tensors)
  with pytest.raises(convert.ConvertError, match=r"layers\.3\.attn\.wkv\.weight: the checkpoint "
                     r"has \[16, 64\] \(F8_E4M3\) with a scale of \[1, 2\], the config expects "
                     r"\[32, 64\] with a scale of \[1, 2\]"):
    convert.import_checkpoint(tiny_cfg(), str(rel), str(tmp_path / "wd"))
  assert_nothing_written(tmp_path)


def test_damaged_files_are_one_line_errors(tmp_path, release):
  from launch import safetensors as st
  rel = copy_release(release, tmp_path / "missing")
  os.remove(shard_of(rel))
  with pytest.raises(convert.ConvertError, match="shard model-00001-of-00001.safetensors named by "):
    convert.import_checkpoint(tiny_cfg(), str(rel), str(tmp_path / "wd"))
  rel = copy_release(release, tmp_path / "truncated")
  size = os.path.getsize(shard_of(rel))
  with open(shard_of(rel), "r+b") as f:
    f.truncate(size - 100)
  with pytest.raises(st.FormatError, match="is truncated: tensor head.weight ends at byte"):
    convert.import_checkpoint(tiny_cfg(), str(rel), str(tmp_path / "wd"))
  rel = copy_release(release, tmp_path / "dtype")
  with open(shard_of(rel), "r+b") as f:
    raw = f.read()
    f.seek(0)
    f.write(raw.replace(b'"dtype":"F32"', b'"dtype":"F4X"', 1))
  with pytest.raises(st.FormatError, match="has the unknown dtype 'F4X'"):
    convert.import_checkpoint(tiny_cfg(), str(rel), str(tmp_path / "wd"))
  assert_nothing_written(tmp_path)


def test_config_disagreement_names_the_fields(tmp_path, release):
  cfg = tiny_cfg()
  cfg.model.yarn_enabled = True
  cfg.model.index_topk = 4
  with pytest.raises(convert.ConvertError, match=r"config.model.index_topk is 4 in the config, 8 "
                     r"in the checkpoint; config.model.yarn_enabled is True in the config, False"):
    convert.import_checkpoint(cfg, str(release), str(tmp_path / "wd"))
  rel = copy_release(release, tmp_path / "rel")
  config = json.load(open(rel / "config.json"))
  config["text_config"]["hidden_act"] = "gelu"
  config["text_config"]["sliding_window_pattern"] = [1]
  json.dump(config, open(rel / "config.json", "w"))
  with pytest.raises(convert.ConvertError, match=r"hidden_act = 'gelu' \(this model has 'silu'\); "
                     "sliding_window_pattern \\(unknown field\\)"):
    convert.import_checkpoint(tiny_cfg(), str(rel), str(tmp_path / "wd"))
  assert_nothing_written(tmp_path)


def test_no_overwrite_without_the_flag_and_no_partial_output(tmp_path, release):
  os.makedirs(tmp_path / "wd")
  (tmp_path / "wd" / "mine.txt").write_text("keep")
  with pytest.raises(convert.ConvertError, match="exists; pass --overwrite to replace it"):
    convert.import_checkpoint(tiny_cfg(), str(release), str(tmp_path / "wd"))
  assert (tmp_path / "wd" / "mine.txt").read_text() == "keep"
  # A NaN scale (E8M0 0xFF) fails while tensors are written: the old directory stays, no leftovers.
  rel = copy_release(release, tmp_path / "rel")
  from launch import safetensors as st
  info = st.read_header(shard_of(rel))["layers.11.ffn.experts.7.w2.scale"]
  with open(shard_of(rel), "r+b") as f:
    f.seek(info.offset)
    f.write(b"\xff")
  with pytest.raises(Exception, match="layers.11.ffn.experts.7.w2.weight: the scale holds NaN"):
    convert.import_checkpoint(tiny_cfg(), str(rel), str(tmp_path / "wd"), overwrite=True)
  assert (tmp_path / "wd" / "mine.txt").read_text() == "keep"
  assert sorted(os.listdir(tmp_path)) == ["rel", "wd"]
  convert.import_checkpoint(tiny_cfg(), str(release), str(tmp_path / "wd"), overwrite=True)
  assert not (tmp_path / "wd" / "mine.txt").exists()
  assert sorted(os.listdir(tmp_path)) == ["rel", "wd"]


def test_the_command_line_prints_one_error_line(tmp_path, release):
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run(
      [sys.executable, "-m", "launch.convert", "import", "--config=configs/tiny.py",
       f"--checkpoint={tmp_path / 'nothing'}", f"--workdir={tmp_path / 'wd'}"],
      cwd=repo, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {tmp_path / 'nothing'}/config.json does not exist (a released checkpoint has "
      "config.json beside its shards)")


@pytest.mark.slow  # one training compile (~3 min on 2 loaded cores)
def test_train_starts_from_an_import(tmp_path, caplog):
  """launch.train on an imported work directory: step 0, the imported weights, a fresh optimizer
  state, and a log line saying so."""
  from launch import train
  cfg = micro_cfg(tmp_path)
  cfg.train.steps = 1
  cfg.train.compilation_cache_dir = ""
  random_workdir(tmp_path / "run", cfg)
  convert.export_checkpoint(str(tmp_path / "run"), str(tmp_path / "rel"))
  convert.import_checkpoint(cfg, str(tmp_path / "rel"), str(tmp_path / "wd"))
  imported = weights(tmp_path / "wd", cfg)
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "wd"), 3)
  assert checkpointer.steps() == [0] and checkpointer.imported["step"] == 0
  checkpointer.close()
  with caplog.at_level(logging.INFO, logger="dsv41"):
    logging.getLogger("dsv41").propagate = True
    summary = train.run(cfg, str(tmp_path / "wd"))
  assert summary["start_step"] == 0 and summary["end_step"] == 1
  assert "from the weights launch.convert imported from" in caplog.text
  assert "the optimizer state is fresh" in caplog.text
  # One step moved the imported weights a little: it trained them, not a fresh initialisation
  # (whose embedding has unit scale, against 0.05 here).
  after = weights(tmp_path / "wd", cfg)
  change = np.abs(after["embed"] - imported["embed"]).max()
  assert 0 < change < 0.02, change


def test_saved_chunks_are_blocks_not_single_rows(tmp_path, monkeypatch):
  """save_weights' chunks (what an export reads at a time): a leaf over SAVE_CHUNK_BYTES is split by
  its leading (layer, expert) axes, a table by blocks of rows within the budget, never one chunk per
  row (the old rule's 1.2 M chunks of 256 bytes made an s1 export take 816 s); a small leaf is one
  chunk. Fails on the old rule (shard_axes = all but the last two axes, or axis 0)."""
  monkeypatch.setattr(convert, "SAVE_CHUNK_BYTES", 16 * 1024)
  rng = np.random.default_rng(0)
  params = {"table": rng.normal(size=(4096, 8)).astype(np.float32),      # 128 KB
            "experts": rng.normal(size=(2, 3, 16, 64)).astype(np.float32),  # 24 KB, 4 KB per expert
            "small": rng.normal(size=(2, 8, 8)).astype(np.float32)}
  bias = np.zeros((2, 2, 3), np.float32)
  convert.save_weights(str(tmp_path), 0, params, bias, {"experts": 2, "small": 1})
  reader = convert.LeafReader(os.path.join(tmp_path, "checkpoints", "0", "state"))
  rows = reader.chunk("table")
  assert rows[1] == 8 and 64 <= rows[0] <= 512 and rows[0] * 32 <= 16 * 1024, rows
  assert reader.chunk("experts") == (1, 1, 16, 64)
  assert reader.chunk("small") == (2, 8, 8)
  assert reader.row_step("table") % rows[0] == 0
  for path, x in params.items():
    np.testing.assert_array_equal(reader.read(path, ()), x)
