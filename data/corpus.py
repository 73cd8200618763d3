"""The default corpus, available offline on any machine (docs/design.md §T3).

Text: the Python standard library's `.py` files, paths sorted, excluding `site-packages`,
`__pycache__` and test directories (`test`, `tests`, `idle_test`), empty files and files that are
not UTF-8. Multimodal: the generated shape documents of `data/shapes.py`.

The manifest records the interpreter (version, implementation, stdlib directory), every text
file (relative path, bytes, SHA-256), what was excluded and why, the split rule and the number of
generated documents; its `hash` covers all of it. Different Python versions ship different
stdlibs (3.11 on the CPU machines, 3.12 on the GPU machine), so they get different manifest hashes
-- and different cached tokenizers -- instead of silently differing. The split is by path: a file
is held out when `int(sha256(path)[:8], 16) % 100 < heldout_percent`, so a file keeps its side
across Python versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig

from data import shapes

EXCLUDED_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test")
CAPTIONS_FOR_BPE = 4000  # generated captions added to the BPE training text


def default_cache_dir() -> str:
  return os.environ.get("DSV41_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsv41_jax")


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str, heldout_percent: int) -> bool:
  return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100 < heldout_percent


def build_manifest(heldout_percent: int, image_docs_train: int, image_docs_eval: int,
                   seed: int, root: str | None = None) -> dict:
  """Scan the stdlib (or `root`) and describe the default corpus; see the module docstring."""
  root = root or stdlib_dir()
  files, excluded = [], {"not_utf8": [], "empty": []}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
    for name in sorted(filenames):
      if not name.endswith(".py"):
        continue
      path = os.path.join(dirpath, name)
      rel = os.path.relpath(path, root)
      with open(path, "rb") as f:
        data = f.read()
      try:
        text = data.decode("utf-8")
      except UnicodeDecodeError:
        excluded["not_utf8"].append(rel)
        continue
      if not text.strip():
        excluded["empty"].append(rel)
        continue
      files.append([rel, len(data), hashlib.sha256(data).hexdigest(),
                    "eval" if is_heldout(rel, heldout_percent) else "train"])
  files.sort(key=lambda f: f[0])
  manifest = {
      "python": {"version": platform.python_version(), "implementation": sys.implementation.name},
      "stdlib_dir": root,
      "rules": {"suffix": ".py", "excluded_dirs": list(EXCLUDED_DIRS),
                "split": "eval iff int(sha256(relpath)[:8], 16) % 100 < heldout_percent"},
      "heldout_percent": heldout_percent,
      "files": files,
      "excluded": excluded,
      "text_bytes": {s: sum(f[1] for f in files if f[3] == s) for s in ("train", "eval")},
      "image_docs": {"generator": "data/shapes.py", "seed": seed, "train": image_docs_train,
                     "eval": image_docs_eval},
  }
  manifest["hash"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
  return manifest


def write_manifest(manifest: dict, cache_dir: str) -> str:
  folder = os.path.join(cache_dir, "corpus")
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f"manifest-{manifest['hash'][:16]}.json")
  if not os.path.exists(path):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump(manifest, f, indent=1)
    os.replace(tmp, path)
  return path


class StdlibSource:
  """The text files of one split, as `("text", bytes, None)` payloads, in manifest order."""

  def __init__(self, manifest: dict, split: str):
    self.paths = [os.path.join(manifest["stdlib_dir"], f[0]) for f in manifest["files"]
                  if f[3] == split]
    self.split = split
    if not self.paths:
      raise ValueError(f"default corpus split {split!r} holds no stdlib file "
                       f"(heldout_percent={manifest['heldout_percent']})")

  def __len__(self):
    return len(self.paths)

  def __getitem__(self, i):
    with open(self.paths[i], "rb") as f:
      return ("text", f.read(), None)

  def __repr__(self):
    return f"StdlibSource({self.split!r}, {len(self.paths)} files)"


def bpe_texts(manifest: dict):
  """Training text of the default BPE: the train stdlib files, then generated captions."""
  for text_payload in (StdlibSource(manifest, "train")[i] for i in range(
      sum(f[3] == "train" for f in manifest["files"]))):
    yield text_payload[1].decode("utf-8")
  seed = manifest["image_docs"]["seed"]
  for i in range(min(CAPTIONS_FOR_BPE, manifest["image_docs"]["train"])):
    for seg in shapes.segments_text(shapes.scene(seed, "train", i)):
      yield seg


def sources(manifest: dict, split: str):
  """(text source, multimodal source) of one split of the default corpus."""
  docs = manifest["image_docs"]
  return StdlibSource(manifest, split), shapes.ShapesSource(docs["seed"], split, docs[split])
