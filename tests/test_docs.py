"""The documentation site builds with warnings as errors and documents the whole API."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import exdyna_jax

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_api_page_lists_every_public_name():
  api = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^\.\. auto(?:function|class):: exdyna_jax\.(\w+)", api, re.M))
  assert documented == set(exdyna_jax.__all__)


def test_docs_build_without_warnings(tmp_path):
  out = tmp_path / "html"
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)],
      capture_output=True, text=True, timeout=300, check=False,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  for page in ["index", "quickstart", "how_exdyna_works", "choosing_a_method", "usage",
               "reproducing_papers", "bad_inputs", "multihost", "api"]:
    assert (out / f"{page}.html").exists(), page
  api = (out / "api.html").read_text()
  for name in exdyna_jax.__all__:
    assert f'id="exdyna_jax.{name}"' in api, name
  choosing = (out / "choosing_a_method.html").read_text()
  for name in exdyna_jax.available_sparsifiers():  # a row of the methods table each
    assert f'<td><p><code class="docutils literal notranslate"><span class="pre">{name}</span>' \
        in choosing, name
