"""docs/ stays true to the code: the design sections the code cites exist, and the config keys the
user guide names are keys of the config tree."""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
GUIDE = ROOT / "docs" / "user_guide.md"
NUM = r"T?\d+(?:\.\d+)*"


def _tracked(*patterns: str) -> list[pathlib.Path]:
  out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    pytest.skip("not a git checkout")
  return [ROOT / p for p in out.stdout.split()]


def test_every_cited_design_section_is_a_heading():
  headings = set(re.findall(r"^#{2,3} (" + NUM + r")\.? ", DESIGN.read_text(), re.M))
  cite = re.compile(r"docs/design\.md\s+(§" + NUM + r"(?:(?:[,;–-]| and |\s)*§" + NUM + r")*)")
  missing = {}
  for path in _tracked("*.py", "*.md"):
    for m in cite.finditer(path.read_text(encoding="utf-8")):
      for section in re.findall(r"§(" + NUM + r")", m.group(1)):
        if section not in headings:
          missing.setdefault(section, []).append(str(path.relative_to(ROOT)))
  assert not missing, f"sections cited but not in docs/design.md: {missing}"


def test_config_keys_in_the_user_guide_exist():
  from configs import tiny
  cfg = tiny.get_config()
  text = GUIDE.read_text()
  keys = set(re.findall(r"(?:--config\.|`)((?:data|train|optim|mesh|model)(?:\.[a-z_0-9]+)+)", text))
  unknown = []
  for key in sorted(keys):
    parts = key.split(".")
    if (ROOT / parts[0] / f"{parts[1]}.py").exists():  # a module path (`optim.chain.…`)
      continue
    node = cfg
    for p in parts:
      if node is None or p not in node:
        unknown.append(key)
        break
      node = node[p]
  assert keys and not unknown, f"the user guide names config keys that do not exist: {unknown}"
