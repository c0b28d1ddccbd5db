"""The documentation site builds with warnings as errors and documents the whole API.

Also: the sessions of the checkpointing page run, the figure script runs,
the benchmark report and the figures land in the built site, and the README
stays short and links to the pages.
"""

from __future__ import annotations

import doctest
import html
import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax

pytestmark = pytest.mark.slow  # the tools end to end: `-m "not slow"` leaves them out

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ["index", "quickstart", "how_exdyna_works", "choosing_a_method", "usage",
         "sharded_models", "multihost", "checkpointing", "benchmarks", "reproducing_papers",
         "bad_inputs", "package_map", "api"]


def test_api_page_lists_every_public_name():
  api = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^\.\. auto(?:function|class):: exdyna_jax\.(\w+)$", api, re.M))
  assert documented == set(exdyna_jax.__all__)


def test_every_page_is_in_the_toctree():
  index = (DOCS / "index.md").read_text()
  toctree = "\n".join(re.findall(r"```\{toctree\}(.*?)```", index, re.S))
  for page in PAGES[1:]:
    assert re.search(rf"^{page}$", toctree, re.M), page
    assert (DOCS / f"{page}.md").exists(), page


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("docs")
  out = tmp / "html"
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(tmp / "doctrees"), str(DOCS), str(out)],
      capture_output=True, text=True, timeout=300, check=False,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  return out


def test_docs_build_without_warnings(site):
  for page in PAGES:
    assert (site / f"{page}.html").exists(), page
  api = (site / "api.html").read_text()
  for name in exdyna_jax.__all__:
    assert f'id="exdyna_jax.{name}"' in api, name
  choosing = (site / "choosing_a_method.html").read_text()
  for name in exdyna_jax.available_sparsifiers():  # a row of the methods table each
    assert f'<td><p><code class="docutils literal notranslate"><span class="pre">{name}</span>' \
        in choosing, name


def test_api_cross_references_are_links(site):
  """`name` in a docstring links to that name's entry; nothing renders as <cite>."""
  api = (site / "api.html").read_text()
  assert "<cite>" not in api
  for name in ("exdyna", "SparsifierStats", "get_stats", "ExDynaState", "data_parallel"):
    assert f'href="#exdyna_jax.{name}"' in api, name


def test_api_page_shows_every_docstring_example(site):
  api = (site / "api.html").read_text()
  anchors = sorted((api.index(f'id="exdyna_jax.{name}"'), name) for name in exdyna_jax.__all__)
  for (start, name), (end, _) in zip(anchors, [*anchors[1:], (len(api), "")], strict=True):
    assert "&gt;&gt;&gt;" in api[start:end], name


def test_benchmarks_page_includes_the_report_with_its_figures(site):
  report = (ROOT / "benchmarks" / "results" / "REPORT.md").read_text()
  page = (site / "benchmarks.html").read_text()
  headings = re.findall(r"^#{2,3} (.+)$", report, re.M)
  assert len(headings) >= 10

  def words(text):  # letters and digits only: markup, entities and smart quotes differ
    return re.sub(r"\W", "", html.unescape(re.sub(r"<[^>]+>", "", text)))

  text = words(page)
  for heading in headings:
    assert words(heading.replace("`", "")) in text, heading
  figures = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", report)
  assert figures
  for figure in figures:
    name = pathlib.PurePosixPath(figure).name
    assert f'src="_images/{name}"' in page, figure
    assert (site / "_images" / name).stat().st_size > 0, figure


def test_how_exdyna_works_shows_the_figures_made_by_the_script(site):
  spec = importlib.util.spec_from_file_location("make_figures", DOCS / "make_figures.py")
  make_figures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_figures)
  source = (DOCS / "how_exdyna_works.md").read_text()
  page = (site / "how_exdyna_works.html").read_text()
  assert "python docs/make_figures.py" in source
  for name in make_figures.FIGURES:
    assert f"_static/{name}" in source, name
    assert (DOCS / "_static" / name).stat().st_size > 10_000, name
    assert f'src="_images/{name}"' in page, name


def test_figure_script_runs_at_tiny_size(tmp_path, capsys):
  spec = importlib.util.spec_from_file_location("make_figures", DOCS / "make_figures.py")
  make_figures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_figures)
  summary = make_figures.main(["--smoke", "--out", str(tmp_path)])
  for name in make_figures.FIGURES:
    assert (tmp_path / name).stat().st_size > 10_000, name
  assert summary["target_k"] == 850  # 1 % of the digits MLP's 85,002 parameters
  assert set(summary) == {"target_k", "exdyna/adaptive", "exdyna/reference", "micro/adaptive"}
  assert '"target_k": 850' in capsys.readouterr().out


def test_checkpointing_page_sessions_run(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # the page saves to ./checkpoints
  result = doctest.testfile(
      str(DOCS / "checkpointing.md"), module_relative=False, report=True,
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False,
  )
  assert result.attempted > 30
  assert result.failed == 0
  assert (tmp_path / "checkpoints" / "step_5").is_dir()


def _readme_code() -> str:
  """The README's first Python block: its usage snippet."""
  return re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


def test_readme_training_step_runs():
  """The README's code, with a model, a batch and a loss it leaves to the reader."""
  block = _readme_code()
  assert len(block.strip().splitlines()) <= 16
  x = np.random.default_rng(0).normal(size=(64, 128)).astype(np.float32)

  def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)

  namespace = {"loss_fn": loss_fn, "params": {"w": jnp.zeros((128, 128))}, "batch": (x, 2 * x)}
  exec(block, namespace)
  stats = namespace["stats"]
  k = int(0.001 * 128 * 128)  # the first step, before the controller has measured anything
  assert int(stats.step) == 1 and k // 2 <= int(stats.transmitted) <= math.ceil(1.1 * k)
  assert namespace["params"]["w"].shape == (128, 128)


def test_readme_training_step_runs_as_shown_in_a_fresh_process_with_one_device(tmp_path):
  """A new user's CPU machine: one device, nothing configured; the mesh sizes itself."""
  block = _readme_code()
  script = tmp_path / "readme.py"
  script.write_text(
      "import jax.numpy as jnp\n"
      "loss_fn = lambda params, batch: jnp.mean((batch[0] @ params['w'] - batch[1]) ** 2)\n"
      "params, batch = {'w': jnp.zeros((128, 128))}, (jnp.ones((8, 128)), jnp.ones((8, 128)))\n"
      f"{block}\nprint('devices', jax.device_count(), 'step', int(stats.step))\n")
  env = {key: value for key, value in os.environ.items()
         if key not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**env, "JAX_PLATFORMS": "cpu"}, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "devices 1 step 1" in result.stdout
  assert "data_parallel over one worker" in result.stderr  # and how to get more
  assert "jax_num_cpu_devices" in result.stderr


def test_readme_is_short_and_links_to_the_pages():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 120
  assert 'pip install -e ".[demo]" && exdyna-jax demo' in readme
  assert 'pip install -e ".[dev]" && python -m pytest -q' in readme
  assert "python -m sphinx" in readme
  links = re.findall(r"\]\(([^)#]+)\)", readme)
  for link in links:
    assert (ROOT / link).exists(), link
  for page in PAGES:
    if page != "index":
      assert f"docs/{page}.md" in links, page
