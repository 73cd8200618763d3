"""The public test helpers (dsv41_jax/testing.py): devices, batches as the packer lays them out,
sharded-vs-single comparisons that can fail, collective counts, and the bad-input messages."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from data.documents import Piece
from data.packing import assemble_row, stack_rows
from dsv41_jax import inputs, sharding, testing
from dsv41_jax.layer_plan import build_layer_plan
from dsv41_jax.vision.merge import check_image_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_too_many_devices_names_the_environment_variables():
  have = len(jax.devices())
  with pytest.raises(ValueError, match=rf"asked for {2 * have} CPU devices but jax has {have}: set "
                     rf"XLA_FLAGS=--xla_force_host_platform_device_count={2 * have} and "
                     r"JAX_PLATFORMS=cpu in the environment before jax is imported"):
    testing.cpu_mesh({"data": 2, "tensor": have})
  with pytest.raises(RuntimeError, match=rf"XLA_FLAGS=--xla_force_host_platform_device_count="
                                         rf"{have + 1} and JAX_PLATFORMS=cpu"):
    testing.force_cpu_devices(have + 1)
  mesh = testing.cpu_mesh({"data": 2, "expert": 2})       # a sub-mesh of the first 4 devices
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 2, "engram": 1, "tensor": 1}
  assert set(mesh.devices.flat) == set(jax.devices()[:4])
  assert sharding.batch_axes(mesh) == ("data", "expert")


def test_plugin_gives_a_fresh_pytest_process_8_cpu_devices(tmp_path):
  """`-p dsv41_jax.testing` (which imports jax) still sets the device count in time, keeping the
  other XLA flags and adding XLA's depth-first CPU schedule (user guide §8)."""
  (tmp_path / "test_devices.py").write_text(
      "import os, jax\n"
      "def test_devices():\n"
      "  assert (len(jax.devices()), jax.default_backend()) == (8, 'cpu')\n"
      "  assert os.environ['XLA_FLAGS'] == ('--xla_cpu_enable_fast_math=false '\n"
      "      '--xla_cpu_enable_concurrency_optimized_scheduler=false '\n"
      "      '--xla_force_host_platform_device_count=8')\n")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["XLA_FLAGS"] = "--xla_cpu_enable_fast_math=false"
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "dsv41_jax.testing", "-p",
                        "no:cacheprovider", str(tmp_path / "test_devices.py")], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "1 passed" in out.stdout


def _packer_reference(batch, pad_id, image_token_id, n_images, canvas):
  """The same rows laid out by the project's packer from their documents (data/packing.py)."""
  rows = []
  for b in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][b]
    pieces = []
    for d in range(1, seg.max() + 1):
      at = np.flatnonzero(seg == d)
      starts = [(m, s - at[0]) for m, s in enumerate(batch.get("image_starts", [[]] * (b + 1))[b])
                if at[0] <= s <= at[-1]]
      cells = [batch["image_cells"][b, m] for m, _ in starts]
      pix = [batch["images"][b, m, :42 * h, :42 * w] for (m, _), (h, w) in zip(starts, cells)]
      pieces.append(Piece(batch["tokens"][b, at], np.asarray([s for _, s in starts], np.int32),
                          np.asarray(cells, np.int32).reshape(-1, 2), pix))
    rows.append(assemble_row(pieces, seg.size, n_images, canvas, pad_id, image_token_id))
  return stack_rows(rows)


@pytest.mark.parametrize("vision", [False, True])
def test_packed_batch_is_laid_out_as_the_packer_lays_rows_out(vision):
  overrides = dict(vision=testing.tiny_vision_config()) if vision else {}
  cfg = testing.tiny_config(**overrides)
  spans = (2, 1, 0, 2, 2, 1)
  batch = testing.packed_batch(cfg, 11, batch_size=6, image_spans=spans, pad_id=0,
                               image_token_id=5)
  seg, mask = batch["segment_ids"], batch["image_mask"]
  assert (seg[0].max() >= 2) and (seg[-1, -1] == 0)          # several documents; padding
  starts = mask & ~np.pad(mask, ((0, 0), (1, 0)))[:, :-1]
  assert starts.sum(1).tolist() == list(spans)                # spans never touch
  assert not (batch["image_mask"] & (seg == 0)).any()
  ref = _packer_reference(batch, 0, 5, 2, 84)
  keys = ["tokens", "targets", "loss_mask", "segment_ids", "positions", "image_mask"]
  if vision:
    keys += ["images", "image_count", "image_cells", "image_starts"]
    check_image_batch(batch, cell_px=42, max_image_size=84)
  for k in keys:
    np.testing.assert_array_equal(batch[k], ref[k], err_msg=k)
  # Engram rows exactly as launch/train.py computes them, with the image mask.
  want = inputs.engram_ids(cfg, ref["tokens"], ref["segment_ids"], ref["image_mask"])
  assert set(batch["engram_ids"]) == set(cfg.engram_layer_ids) == set(want)
  for layer in want:
    np.testing.assert_array_equal(batch["engram_ids"][layer], want[layer])


def test_tiny_config_covers_every_mode_and_takes_overrides():
  plan = build_layer_plan(testing.tiny_config())
  assert {l.mode for l in plan} == {"swa", "full", "reuse", "reindex"}
  assert plan.num_encoder_layers == 4 and testing.tiny_config().engram_layer_ids == (0, 1)
  cfg = testing.tiny_config(kv_source_input="encoder_final", moe_dispatch="capacity")
  assert (cfg.kv_source_input, cfg.moe_dispatch, cfg.hidden_size) == ("encoder_final",
                                                                      "capacity", 32)


def _matmul_inputs(rows=8):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, 16)).astype(np.float32),
          rng.normal(size=(16, 24)).astype(np.float32))


def _missing_psum(x, w):
  """x @ w, but on a mesh each tensor shard keeps its partial sum: a sharding bug."""
  if jax.sharding.get_abstract_mesh().empty:
    return jnp.tanh(x @ w)
  part = jax.shard_map(lambda a, b: a @ b, in_specs=(P(None, "tensor"), P("tensor", None)),
                       out_specs=P(), check_vma=False)(x, w)
  return jnp.tanh(part)


def test_comparison_passes_a_correct_program_and_fails_a_wrong_one():
  mesh = testing.cpu_mesh({"data": 2, "tensor": 2})
  x, w = _matmul_inputs()
  good = lambda x, w: jnp.tanh(x @ w)
  # Reordered float32 sums of ≤ 24 products of unit normals: a few ulps of ~24·|term| = 1e-5; a
  # missing partial sum is O(1).
  for float64 in (False, True):
    result = testing.assert_sharded_matches(
        good, (x, w), mesh, in_specs=("batch", P(None, "tensor")), grad_argnums=(0, 1),
        float64=float64, rtol=1e-5, atol=1e-5)
    y, (gx, gw) = result.single
    assert result.sharded[1][1].sharding.spec == P(None, "tensor")
    assert np.abs(np.asarray(gw)).max() > 0 and gx.shape == x.shape
  assert result.float64[0].dtype == np.float64
  for float64 in (False, True):
    with pytest.raises(AssertionError, match=r"output\[0\]"):
      testing.assert_sharded_matches(_missing_psum, (x, w), mesh,
                                     in_specs=(P(None, "tensor"), P("tensor", None)),
                                     grad_argnums=1, float64=float64)


def test_comparison_takes_a_second_sample_one_ulp_away():
  """`float64_perturbed`: the single-device program runs again with every non-zero float32
  argument one ulp away, the rule takes the larger of the two errors, and it still fails a
  missing partial sum."""
  mesh = testing.cpu_mesh({"data": 2, "tensor": 2})
  x, w = _matmul_inputs()
  x[0, 0] = 0.0
  good = lambda x, w: jnp.tanh(x @ w)
  result = testing.assert_sharded_matches(
      good, (x, w), mesh, in_specs=("batch", P(None, "tensor")), grad_argnums=(0, 1),
      float64=True, float64_perturbed=True)
  moved = testing._one_ulp_away((x, w), 0)
  for a, b in zip((x, w), moved):
    steps = np.abs(b.view(np.int32).astype(np.int64) - a.view(np.int32))
    assert b.dtype == np.float32 and np.all(steps[a != 0] == 1) and np.all(b[a == 0] == 0)
    assert 0 < (b > a).mean() < 1                     # both directions
  y, y_moved = np.asarray(result.single[0]), np.asarray(result.single_perturbed[0])
  np.testing.assert_allclose(y_moved, np.tanh(np.asarray(moved[0], np.float64) @ moved[1]),
                             rtol=1e-5, atol=1e-6)
  assert not np.array_equal(y_moved, y)
  with pytest.raises(AssertionError, match=r"output\[0\]: sharded run is .*\(one ulp away"):
    testing.assert_sharded_matches(_missing_psum, (x, w), mesh,
                                   in_specs=(P(None, "tensor"), P("tensor", None)),
                                   grad_argnums=1, float64=True, float64_perturbed=True)
  with pytest.raises(ValueError, match="float64_perturbed samples .* pass float64 too"):
    testing.assert_sharded_matches(lambda x, w: pytest.fail("ran"), (x, w), mesh,
                                   float64_perturbed=True)


def test_bad_inputs_name_the_problem():
  mesh = testing.cpu_mesh({"data": 2, "expert": 2})
  x, w = _matmul_inputs(rows=6)
  with pytest.raises(ValueError, match=r"argument 0 has batch \(leading\) dimension 6, which the "
                     r"mesh's batch axes data × expert = 4 do not divide"):
    testing.assert_sharded_matches(lambda x, w: x @ w, (x, w), mesh, in_specs=("batch", None))
  batch = {"rows": x[:4], "scale": np.float32(3.0)}   # a scalar in a batch argument: replicated
  testing.assert_sharded_matches(lambda b: b["rows"] * b["scale"], (batch,), mesh, rtol=0, atol=0)
  with pytest.raises(ValueError, match=r"argument 1\['tokens'\] has batch \(leading\) dimension 6"):
    testing.assert_sharded_matches(lambda w, b: b["tokens"] @ w, (w, {"tokens": x}), mesh,
                                   in_specs=(None, "batch"))
  with pytest.raises(TypeError, match=r"returned a str at output\['name'\]; assert_sharded_matches "
                     r"compares arrays"):
    testing.assert_sharded_matches(lambda x: {"y": x, "name": "y"}, (x[:4],), mesh)
  with pytest.raises(TypeError, match="count_collectives takes a jax.stages.Compiled"):
    testing.count_collectives(lambda x: x)


def test_count_collectives():
  mesh = testing.cpu_mesh({"data": 4, "tensor": 2})
  x, w = _matmul_inputs()
  replicated_sum = testing.compile_sharded(lambda x: x.sum(0), (x,), mesh)
  counts = testing.count_collectives(replicated_sum)
  assert counts["all-reduce"] >= 1 and counts["all-gather"] == counts["all-to-all"] == 0
  local = testing.compile_sharded(lambda x: 2 * x, (x,), mesh)
  assert testing.count_collectives(local) == dict.fromkeys(testing.COLLECTIVES, 0)
  text = ("%ag = f32[8]{0} all-gather-start(f32[4]{0} %p), dimensions={0}\n"
          "%d = f32[8]{0} all-gather-done(f32[8]{0} %ag)\n"
          "%t = (f32[2]{0}, f32[2]{0}) all-to-all(f32[2]{0} %a, f32[2]{0} %b)\n"
          "%all-reduce.3 = f32[] all-reduce(f32[] %all-reduce.2), to_apply=%add\n")
  assert testing.count_collectives(text) == {"all-reduce": 1, "all-gather": 1,
                                             "reduce-scatter": 0, "all-to-all": 1,
                                             "collective-permute": 0}


def test_single_device_groups_in_both_hlo_formats():
  """Replica groups as jax 0.10 prints them (listed, iota) and as jax 0.11 does (mesh axes)."""
  line = "%s = f32[512,8]{1,0} all-reduce(f32[512,8]{1,0} %x), channel_id=1, replica_groups="
  alone = ["{{0},{1},{2},{3}}", "[4,1]<=[4]",
           "mesh['data'=2,'fsdp'=1,'expert'=1,'engram'=2,'tensor'=1] {'tensor'}",
           "mesh['data'=2,'fsdp'=1,'tensor'=1] {'fsdp','tensor'}"]
  shared = ["{{0,1},{2,3}}", "[2,2]<=[4]",
            "mesh['data'=2,'fsdp'=1,'expert'=1,'engram'=2,'tensor'=1] {'engram'}",
            "mesh['data'=2,'fsdp'=1,'tensor'=1] {'data','tensor'}"]
  assert all(testing.single_device_groups(line + g + ", to_apply=%add") for g in alone)
  assert not any(testing.single_device_groups(line + g + ", to_apply=%add") for g in shared)
