"""The examples in the docstrings run, and every public name has one.

Every module of the package is searched with `doctest.DocTestFinder` and its
examples run on the 8 forced CPU devices of ``conftest.py`` (the examples
simulate workers with ``jax.vmap(..., axis_name="data", axis_size=n)`` or use
those devices through ``jax.shard_map``/``jax.pmap``). Outputs are compared
with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``; examples print shapes, counts
and rounded numbers so that they read the same on every machine.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import io
import pkgutil
import re

import pytest

import exdyna_jax

# Importing a ``__main__`` runs its command line.
SKIP_MODULES = frozenset({"exdyna_jax.__main__", "exdyna_jax.launch.__main__"})
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_names() -> list[str]:
  names = ["exdyna_jax"]
  for info in pkgutil.walk_packages(exdyna_jax.__path__, "exdyna_jax."):
    if info.name not in SKIP_MODULES:
      names.append(info.name)
  return sorted(names)


MODULES = module_names()


def doctests_of(module_name: str) -> list[doctest.DocTest]:
  module = importlib.import_module(module_name)
  return [t for t in doctest.DocTestFinder().find(module) if t.examples]


def test_the_walk_finds_the_package_modules():
  for name in ("exdyna_jax.methods.exdyna._exdyna", "exdyna_jax.parallel._sharding",
               "exdyna_jax.launch", "exdyna_jax.wrappers._hierarchical", "exdyna_jax.demo.trainer"):
    assert name in MODULES, name


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
  runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
  report = io.StringIO()
  for test in doctests_of(module_name):
    runner.run(test, out=report.write)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, report.getvalue()


def _example_section(doc: str) -> str | None:
  """The ``Example:``/``Examples:`` section of a Google docstring, or None."""
  match = re.search(r"^(\s*)Examples?:\s*\n((?:\1\s+.*\n|\s*\n)+)", doc + "\n", re.M)
  return match.group(2) if match else None


@pytest.mark.parametrize("name", exdyna_jax.__all__)
def test_every_public_name_has_an_example_that_runs(name):
  obj = getattr(exdyna_jax, name)
  section = _example_section(inspect.getdoc(obj) or "")
  assert section is not None, f"{name} has no 'Example:' section"
  assert ">>>" in section, f"{name}'s 'Example:' section has no >>> lines"
  qualified = f"{obj.__module__}.{obj.__qualname__}"
  found = {t.name for t in doctests_of(obj.__module__)}
  assert qualified in found, f"the doctest finder does not collect {qualified}"
