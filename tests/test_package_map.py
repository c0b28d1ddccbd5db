"""docs/package_map.md matches the package: every module listed, imports run one way."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exdyna_jax"
MAP = (ROOT / "docs" / "package_map.md").read_text()
MAX_LINES = 400


def package_modules() -> set[str]:
  """Modules under ``exdyna_jax/`` (package ``__init__`` files aside)."""
  return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def package_imports(path: pathlib.Path) -> set[str]:
  """Top-level modules of ``exdyna_jax`` that ``path`` imports."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "exdyna_jax":
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("exdyna_jax."):
      found.add(node.module.split(".")[1])
  return found


def layers() -> dict[str, int]:
  """Module -> layer, from the numbered list under 'Which way imports run'."""
  section = MAP.split("## Which way imports run", 1)[1].split("\n## ", 1)[0]
  out = {}
  for number, text in re.findall(r"^(\d)\. (.*(?:\n   .*)*)", section, flags=re.M):
    for name in re.findall(r"`(_?\w+)`", text):
      out.setdefault(name, int(number))
  return out


def test_every_module_is_on_the_map_and_every_mapped_module_exists():
  named = set(re.findall(r"`((?:demo/)?\w+\.py)`", MAP))
  modules = package_modules()
  assert modules - named == set(), "modules missing from docs/package_map.md"
  assert named - modules == set(), "docs/package_map.md names modules that do not exist"


def test_imports_run_from_lower_layers_only():
  rank = layers()
  assert {"_layout", "_feedback", "_exdyna", "_registry"} <= rank.keys()
  for name, layer in rank.items():
    path = PACKAGE / f"{name}.py"
    for imported in package_imports(path):
      if imported not in rank:
        continue
      allowed = rank[imported] < layer or (layer == rank[imported] == 5)  # micro on exdyna
      assert allowed, f"{name} (layer {layer}) imports {imported} (layer {rank[imported]})"


def test_no_module_is_longer_than_a_few_screens():
  for path in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
    assert len(path.read_text().splitlines()) <= MAX_LINES, path


def test_the_step_counter_is_advanced_in_one_place():
  """``stats.step`` is advanced by the shell's guard only; a method reports, it does not count."""
  writers = {
      str(path.relative_to(PACKAGE))
      for path in PACKAGE.rglob("*.py")
      if re.search(r"\bstep=[^,\n]*stats\.step\s*\+", path.read_text())
  }
  assert writers == {"_guard.py"}, writers


def test_the_demo_uses_the_public_api_only():
  """The demo is what a user could write: it imports no private module of the library."""
  private = {
      str(path.relative_to(PACKAGE)): sorted(n for n in package_imports(path) if n.startswith("_"))
      for path in (PACKAGE / "demo").rglob("*.py")
  }
  assert {name: found for name, found in private.items() if found} == {}
