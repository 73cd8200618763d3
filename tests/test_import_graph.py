"""Imports flow one way: no circle among the modules of the code packages, and every edge points down.

The graph is read from the source with `ast`: an edge for every `import` anywhere in a module, at
the top or inside a function (a function-level import does not break a circle, it hides it), and
none for imports under `if TYPE_CHECKING:`, which never run. `from pkg import name` is an edge to
the submodule `pkg.name` when there is one, else to `pkg` itself.

Direction (docs/design.md §T5, shared STYLE "Imports flow one way"), as layers from the bottom:
the ops (`pallas_kernels.ops`, jax / numpy / stdlib only) < the kernels and the dispatcher
(`pallas_kernels`) < the model (`dsv41_jax`) and the optimizer (`optim`, which names parameters by
the ops' `path_str` and never imports the model) < `configs` < `launch`; `data` imports nothing of
ours. `LAYERS` says which layers each may import.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dsv41_jax", "optim", "pallas_kernels", "launch", "data", "configs")
OPS = "pallas_kernels.ops"
# layer -> the other layers its modules may import.
LAYERS: dict[str, set[str]] = {
    OPS: set(),
    "pallas_kernels": {OPS},
    "data": set(),
    "optim": {OPS, "pallas_kernels"},
    "dsv41_jax": {OPS, "pallas_kernels"},
    "configs": {OPS, "pallas_kernels", "dsv41_jax", "optim", "data"},
    "launch": {OPS, "pallas_kernels", "dsv41_jax", "optim", "data", "configs"},
}
# What the ops may import from outside the project.
OPS_EXTERNAL = {"jax", "numpy"} | set(sys.stdlib_module_names)


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
  skip = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
  return skip


def imports_of(name: str, source: str, is_package: bool, modules) -> set[str]:
  """The modules of `modules` that module `name` (with this source) imports."""

  def owner(mod: str) -> str | None:
    while mod and mod not in modules:
      mod = mod.rpartition(".")[0]
    return mod or None

  tree = ast.parse(source)
  skip = _type_checking_nodes(tree)
  targets: set[str | None] = set()
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      targets.update(owner(a.name) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
          package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
      for a in node.names:
        sub = f"{base}.{a.name}"
        targets.add(sub if sub in modules else owner(base))
  return {t for t in targets if t is not None and t != name}


def import_graph() -> dict[str, set[str]]:
  """module -> the package modules it imports."""
  modules = _modules()
  return {name: imports_of(name, path.read_text(), path.name == "__init__.py", modules)
          for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  cycles = []

  def visit(v: str):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return cycles


def test_the_graph_sees_every_import_that_runs():
  source = """
import p.a
from p import b, NAME
from p.c import thing
from . import d
from .e import other
import numpy
from typing import TYPE_CHECKING
if TYPE_CHECKING:
  from p import f
def later():
  from p.g.h import x
"""
  modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e", "p.f", "p.g", "p.g.h", "p.mod"}
  assert imports_of("p.mod", source, False, modules) == {
      "p.a", "p.b", "p", "p.c", "p.d", "p.e", "p.g.h"}
  assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert "pallas_kernels.ops.paths" in import_graph()["optim.table"]
  # the direction check flags an optimizer that imports the model, and a kernel that reads launch
  bad = {"optim.table": {"dsv41_jax.param_paths", "pallas_kernels.ops.paths"},
         "pallas_kernels.mhc": {"pallas_kernels.ops.mhc", "launch.train"},
         "pallas_kernels.ops.mhc": {"pallas_kernels.notices"}, "data.mixture": set()}
  assert wrong_way(bad) == [("optim.table", "dsv41_jax.param_paths"),
                            ("pallas_kernels.mhc", "launch.train"),
                            ("pallas_kernels.ops.mhc", "pallas_kernels.notices")]
  assert external_imports("import jax\nimport flax.nnx\nfrom numpy import ndarray\n") == {
      "jax", "flax", "numpy"}


def layer(module: str) -> str:
  return OPS if module == OPS or module.startswith(OPS + ".") else module.partition(".")[0]


def wrong_way(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
  """Every edge (module, imported) that `LAYERS` does not allow, sorted."""
  return sorted((m, d) for m, deps in graph.items() for d in deps
                if layer(d) != layer(m) and layer(d) not in LAYERS[layer(m)])


def external_imports(source: str) -> set[str]:
  """Top-level names of the packages a module's source imports (relative imports excluded)."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(a.name.partition(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      names.add((node.module or "").partition(".")[0])
  return names


def test_imports_point_down_the_layers():
  edges = wrong_way(import_graph())
  assert not edges, "imports against the layers: " + "; ".join(f"{m} -> {d}" for m, d in edges)


def test_the_ops_import_only_jax_numpy_and_the_standard_library():
  for name, path in _modules().items():
    if layer(name) == OPS:
      extra = external_imports(path.read_text()) - OPS_EXTERNAL - {"pallas_kernels"}
      assert not extra, f"{name} imports {sorted(extra)}"


def test_no_import_cycle_among_the_package_modules():
  cycles = find_cycles(import_graph())
  assert not cycles, "import circles: " + "; ".join(" ↔ ".join(c) for c in cycles)


@pytest.mark.parametrize("module", ["dsv41_jax.layer_plan", "dsv41_jax.vision.config",
                                    "dsv41_jax.config", "dsv41_jax.flops", "dsv41_jax.ledger"])
def test_module_imports_first_in_a_fresh_interpreter(module):
  """The modules that once imported each other in a circle each import on their own."""
  subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True, timeout=120)
