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


def import_order() -> dict[str, int]:
  """Module -> its place in the list under 'Which way imports run'."""
  section = MAP.split("## Which way imports run", 1)[1].split("\n## ", 1)[0]
  names = re.findall(r"`(_?\w+)`", section)
  return {name: place for place, name in enumerate(dict.fromkeys(names))}


def test_every_module_is_on_the_map_and_every_mapped_module_exists():
  named = set(re.findall(r"`((?:demo/)?\w+\.py)`", MAP))
  modules = package_modules()
  assert modules - named == set(), "modules missing from docs/package_map.md"
  assert named - modules == set(), "docs/package_map.md names modules that do not exist"


def test_every_module_imports_only_modules_listed_before_it():
  place = import_order()
  top_level = {p.stem for p in PACKAGE.glob("*.py")}
  assert top_level - place.keys() == set(), "modules missing from the import order"
  for name in top_level - {"__init__"}:
    for imported in package_imports(PACKAGE / f"{name}.py") - {"demo"}:
      assert place[imported] < place[name], f"{name} imports {imported}, listed after it"


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


def test_the_examples_use_the_public_api_and_the_hlo_reader_nothing_of_the_library():
  """Examples are what a user writes: no private module, no demo (their shared helpers are
  ``examples/_common.py``). The HLO reader stands alone, so the tools and tests that check
  the library's byte counts against it do not check the library against itself."""
  found = {path.name: sorted(n for n in package_imports(path) if n.startswith("_") or n == "demo")
           for path in (ROOT / "examples").glob("*.py")}
  assert {name: names for name, names in found.items() if names} == {}
  assert package_imports(PACKAGE / "hlo.py") == set()


def test_no_side_channels_in_the_library():
  """Values, not registries: no context variables, no weak-key maps keyed on objects, and
  no module-level dict or set that code could fill at run time (tables are read-only
  ``types.MappingProxyType``s)."""
  found = []
  for path in PACKAGE.rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = {alias.name for alias in getattr(node, "names", [])}
      if isinstance(node, ast.Import | ast.ImportFrom) and (
          "contextvars" in names or node.__dict__.get("module") == "contextvars"
          or "WeakKeyDictionary" in names):
        found.append(f"{path.name}: imports {sorted(names)}")
      if isinstance(node, ast.Attribute) and node.attr in {"ContextVar", "WeakKeyDictionary"}:
        found.append(f"{path.name}: {node.attr}")
    for statement in tree.body:  # module level only
      value = getattr(statement, "value", None)
      if isinstance(statement, ast.Assign | ast.AnnAssign) and isinstance(
          value, ast.Dict | ast.Set | ast.DictComp | ast.SetComp):
        found.append(f"{path.name}:{statement.lineno}: a mutable module-level container")
  assert found == []
