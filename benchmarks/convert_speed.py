"""Speed and memory of `python -m launch.convert export|import` (issue 30, docs/checkpoints.md
§Speed and memory).

  python -m benchmarks.convert_speed                        # configs/small.py:s1 without its ViT
  python -m benchmarks.convert_speed --size=s2 --dir=/tmp/cs
  python -m benchmarks.convert_speed --profile=export       # cProfile of the export, top 25

Makes a work directory of the config's shapes with random weights (normal × 0.05 per leaf,
written leaf by leaf into memory maps and saved by `convert.save_weights` with an import's chunks),
then runs each command in a fresh process of `python -m launch.convert`: wall seconds; peak
resident memory of that process (VmHWM of /proc/self/status read as it exits: it includes the
interpreter, jax and TensorStore, ~0.3 GB before any tensor, and the file pages of the memory maps
it touched); throughput = the work directory's float32 parameter bytes / seconds, for import and
export alike. Then it exports the import again and checks that both exports decode to the same
values bit for bit: import ∘ export is the identity on the exported values. The ViT is dropped
(`model.vision = None`): neither direction converts it, and an import would spend its time
compiling a fresh initialisation of it.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks.common import header, log, md_header  # noqa: E402

_SIZE = flags.DEFINE_string("size", "s1", "configs/small.py size.")
_DIR = flags.DEFINE_string("dir", None, "Scratch directory (default: a fresh temporary one, "
                           "removed at the end).")
_PROFILE = flags.DEFINE_enum("profile", None, ["export", "import"], "Run this command in this "
                             "process under cProfile and print the top functions instead.")
_SEED = 0


def config(size: str):
  from configs import small
  cfg = small.get_config(size)
  cfg.model.vision = None
  return cfg


def make_workdir(path: str, cfg) -> int:
  """A work directory at step 1 of random parameters of `cfg`'s shapes; returns their bytes."""
  import jax
  import numpy as np
  from configs import common
  from launch import checkpoint as ckpt_lib
  from launch import convert
  from launch import released_layout as rl
  mcfg = common.model_config(cfg)
  pure, _ = convert._abstract_leaves(mcfg)
  scratch = os.path.join(path, "scratch")
  os.makedirs(scratch)
  rng = np.random.default_rng(_SEED)
  total = 0

  def fill(n, leaf):
    nonlocal total
    arr = np.memmap(os.path.join(scratch, f"{n}.bin"), dtype=leaf.dtype, mode="w+",
                    shape=leaf.shape)
    flat = arr.reshape(-1)
    for i in range(0, flat.size, 2**24):   # 64 MB of float32 at a time
      flat[i:i + 2**24] = rng.normal(size=min(2**24, flat.size - i)) * 0.05
    total += arr.nbytes
    return arr

  leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
  params = jax.tree_util.tree_unflatten(treedef, [fill(n, x) for n, (_, x) in enumerate(leaves)])
  bias = rng.normal(size=(mcfg.num_hidden_layers, 2, mcfg.n_routed_experts)).astype(np.float32)
  convert.save_weights(path, 1, params, bias, convert.leading_axes(rl.released_tensors(mcfg)))
  shutil.rmtree(scratch)
  ckpt_lib.write_config(path, cfg.to_dict())
  return total


# launch.convert as __main__, printing its peak resident memory (VmHWM) on the way out
_CHILD = """
import atexit, runpy, sys
def hwm():
  kb = next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]
  print("VmHWM", kb, file=sys.stderr)
atexit.register(hwm)
sys.argv = ["launch.convert"] + sys.argv[1:]
runpy.run_module("launch.convert", run_name="__main__", alter_sys=True)
"""


def run(*args: str) -> tuple[float, float]:
  """(wall seconds, peak RSS in GB) of `python -m launch.convert ARGS` in a fresh process."""
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True)
  seconds = time.perf_counter() - t0
  if proc.returncode:
    raise SystemExit(f"error: launch.convert {args[0]} failed ({proc.returncode}):\n"
                     f"{proc.stderr[-2000:]}")
  log(proc.stdout.strip())
  kb = int(next(l for l in proc.stderr.splitlines() if l.startswith("VmHWM")).split()[1])
  return seconds, kb * 1024 / 1e9


def same_values(a: str, b: str, cfg) -> bool:
  """Whether two released checkpoints of `cfg` decode to the same float32 values, bit for bit
  (tensor by tensor, tables by blocks of rows; the FP8 codes themselves may differ by a power of
  two where a tile's maximum sits low on the grid, docs/checkpoints.md §Storage formats)."""
  import numpy as np
  from configs import common
  from launch import convert
  from launch import released_layout as rl
  from launch import weight_formats as wf
  (_, infos_a, _), (_, infos_b, _) = convert.read_checkpoint(a), convert.read_checkpoint(b)
  block = wf.FP8_TILE   # what export writes
  for t in rl.released_tensors(common.model_config(cfg)):
    step = convert.ROW_BLOCK if t.storage == "fp8_rows" else t.shape[0]
    for r0 in range(0, t.shape[0], step):
      rows = (r0, min(r0 + step, t.shape[0])) if t.storage == "fp8_rows" else None
      x, y = convert.decode(t, infos_a, block, rows), convert.decode(t, infos_b, block, rows)
      if x.shape != y.shape or not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
        log(f"{t.name} differs")
        return False
  return True


def profile(command: str, work: str, released: str, cfg) -> None:
  from launch import convert
  prof = cProfile.Profile()
  if command == "export":
    prof.runcall(convert.export_checkpoint, work, released, overwrite=True)
  else:
    prof.runcall(convert.import_checkpoint, cfg, released, os.path.join(work + "-imported"),
                 overwrite=True)
  pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def main(argv):
  del argv
  base = _DIR.value or tempfile.mkdtemp(prefix="convert_speed-")
  os.makedirs(base, exist_ok=True)
  work, released = os.path.join(base, "work"), os.path.join(base, "released")
  imported, again = os.path.join(base, "imported"), os.path.join(base, "released-again")
  cfg = config(_SIZE.value)
  cfg_file = os.path.join(base, "config.py")   # import's --config: this module's config()
  try:
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    nbytes = make_workdir(work, cfg)
    log(f"random work directory: {nbytes / 1e9:.3f} GB of parameters in "
        f"{time.perf_counter() - t0:.0f} s")
    with open(cfg_file, "w") as f:
      f.write(f"from benchmarks.convert_speed import config\n\n\ndef get_config():\n"
              f"  return config({_SIZE.value!r})\n")
    if _PROFILE.value:
      if _PROFILE.value == "import":
        run("export", f"--workdir={work}", f"--checkpoint={released}", "--overwrite")
      profile(_PROFILE.value, work, released, cfg)
      return
    rows = []
    seconds, rss = run("export", f"--workdir={work}", f"--checkpoint={released}", "--overwrite")
    rows.append(("export", seconds, rss))
    seconds, rss = run("import", f"--config={cfg_file}", f"--checkpoint={released}",
                       f"--workdir={imported}", "--overwrite")
    rows.append(("import", seconds, rss))
    run("export", f"--workdir={imported}", f"--checkpoint={again}", "--overwrite")
    released_bytes = sum(os.path.getsize(os.path.join(released, n)) for n in os.listdir(released))
    identical = same_values(released, again, cfg)
    print(header())
    print(f"model: configs/small.py:{_SIZE.value} without the ViT, {nbytes / 1e9:.3f} GB of "
          f"float32 parameters; released files {released_bytes / 1e9:.3f} GB; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(md_header("command", "seconds", "MB/s (parameters)", "s per GB", "peak RSS (GB)"))
    for name, seconds, rss in rows:
      print(f"| {name} | {seconds:.1f} | {nbytes / 1e6 / seconds:.1f} | "
            f"{seconds / (nbytes / 1e9):.1f} | {rss:.2f} |")
    print(f"export of the import decodes to the first export's values, bit for bit: {identical}")
    if not identical:
      raise SystemExit("error: the second export differs from the first")
  finally:
    if not _DIR.value:
      shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
