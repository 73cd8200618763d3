"""docs/testing.md runs as written: its `python` blocks, in order, then each test they define."""

import pathlib
import re
import types

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def _page_module() -> types.ModuleType:
  """The page's `python` blocks as one module; each line keeps its page line number."""
  text = PAGE.read_text()
  lines = [""] * text.count("\n")
  blocks = list(re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M))
  assert len(blocks) >= 3, f"{PAGE} lost its code blocks"
  for block in blocks:
    first = text.count("\n", 0, block.start(1))
    for i, line in enumerate(block.group(1).splitlines()):
      lines[first + i] = line
  module = types.ModuleType("docs_testing_example")
  exec(compile("\n".join(lines), str(PAGE), "exec"), module.__dict__)
  return module


PAGE_MODULE = _page_module()
PAGE_TESTS = sorted(name for name in vars(PAGE_MODULE) if name.startswith("test_"))


def test_the_page_defines_its_tests():
  assert PAGE_TESTS == ["test_relu2_mlp_communicates_once",
                        "test_relu2_mlp_sharded_equals_single_device",
                        "test_swapped_axes_are_caught_by_the_collective_count"]


@pytest.mark.parametrize("name", PAGE_TESTS)
def test_page(name):
  getattr(PAGE_MODULE, name)()
