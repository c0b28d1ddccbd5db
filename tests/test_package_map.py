"""docs/package_map.md matches the package: every module listed, imports run one way."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exdyna_jax"
MAP = (ROOT / "docs" / "package_map.md").read_text()
MAX_LINES = 400


def only_a_docstring(path: pathlib.Path) -> bool:
  """A folder's ``__init__.py`` that only says what the folder holds."""
  body = ast.parse(path.read_text()).body
  return len(body) == 1 and isinstance(body[0], ast.Expr)


def package_modules() -> set[str]:
  """Paths under ``exdyna_jax/`` (``core/_layout.py``); ``__init__``s of a docstring aside."""
  return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
          if not (p.name == "__init__.py" and only_a_docstring(p))}


def mapped_modules() -> list[str]:
  """Module paths in the order the map lists them: a folder's heading, then its table's rows."""
  section = MAP.split("## The folders, in the order imports run", 1)[1].split("\n## ", 1)[0]
  found, folder = [], ""
  for line in section.splitlines():
    if line.startswith("### "):
      heading = re.match(r"### `([\w/]+/)`", line)
      folder = heading[1] if heading else ""
    elif row := re.match(r"\| `(\w+\.py)` \|", line):
      found.append(folder + row[1])
  return found


def module_path(dotted: str) -> str:
  """``exdyna_jax.core._layout`` -> ``core/_layout.py``; a package -> its ``__init__.py``."""
  relative = pathlib.Path(*dotted.split(".")[1:])
  if (PACKAGE / relative).is_dir():
    return str(relative / "__init__.py")
  return str(relative.with_suffix(".py"))


def package_imports(path: pathlib.Path) -> set[str]:
  """Module paths of ``exdyna_jax`` that ``path`` imports with ``from ... import``."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "exdyna_jax":
      for alias in node.names:
        imported = module_path(f"{node.module}.{alias.name}")
        found.add(imported if (PACKAGE / imported).exists() else module_path(node.module))
  return found


def is_private(module: str) -> bool:
  """A module path with a part of a leading underscore (``__init__.py`` aside)."""
  return any(part.startswith("_") and not part.startswith("__")
             for part in pathlib.Path(module).parts)


def test_every_module_is_on_the_map_in_its_folder_and_every_mapped_module_exists():
  mapped = mapped_modules()
  assert len(mapped) == len(set(mapped)), "a module is named twice"
  modules = package_modules()
  assert modules - set(mapped) == set(), "modules missing from docs/package_map.md"
  assert set(mapped) - modules == set(), "docs/package_map.md names modules that do not exist"


def test_every_module_imports_only_modules_listed_before_it():
  """The library, the launcher and the command; the demo is user code (the test below)."""
  place = {name: i for i, name in enumerate(mapped_modules())}
  for name in place:
    if name.startswith("demo/"):
      continue
    for imported in package_imports(PACKAGE / name):
      if not imported.startswith("demo/"):
        assert place[imported] < place[name], f"{name} imports {imported}, listed after it"


def test_no_module_is_longer_than_a_few_screens():
  for path in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
    assert len(path.read_text().splitlines()) <= MAX_LINES, path


def test_importing_the_package_loads_flax_only_for_its_flax_helpers():
  """A process that only sparsifies (a launcher's worker, a benchmark) starts without Flax."""
  code = ("import sys, exdyna_jax; assert 'flax' not in sys.modules, 'flax loaded'; "
          "exdyna_jax.nnx_step, exdyna_jax.train_state_step; "
          "assert {'flax.nnx', 'flax.training.train_state'} <= set(sys.modules)")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]


def test_the_step_counter_is_advanced_in_one_place():
  """``stats.step`` is advanced by the shell's guard only; a method reports, it does not count."""
  writers = {
      str(path.relative_to(PACKAGE))
      for path in PACKAGE.rglob("*.py")
      if re.search(r"\bstep=[^,\n]*stats\.step\s*\+", path.read_text())
  }
  assert writers == {"shell/_guard.py"}, writers


def test_the_demo_uses_the_public_api_only():
  """The demo is what a user could write: it imports no private module of the library."""
  private = {
      str(path.relative_to(PACKAGE)): sorted(filter(is_private, package_imports(path)))
      for path in (PACKAGE / "demo").rglob("*.py")
  }
  assert {name: found for name, found in private.items() if found} == {}


def test_the_examples_use_the_public_api_and_the_hlo_reader_nothing_of_the_library():
  """Examples are what a user writes: no private module, no demo (their shared helpers are
  ``examples/_common.py``). The HLO reader stands alone, so the tools and tests that check
  the library's byte counts against it do not check the library against itself."""
  found = {path.name: sorted(n for n in package_imports(path)
                              if is_private(n) or n.startswith("demo/"))
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
