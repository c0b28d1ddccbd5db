"""The language-model benchmark runs as documented, and its REPORT section reads its results."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from benchmarks import language_model
from benchmarks.report import _format
from benchmarks.report import language_model as section
from exdyna_jax.demo.language_model import language_model_task
from tests import harness

pytestmark = pytest.mark.slow  # the tools end to end: `-m "not slow"` leaves them out


def test_quick_run_records_each_variant_and_the_report_compares_them_with_ddp(tmp_path):
  out = tmp_path / "language_model.json"
  language_model.main(["--quick", "--out", str(out)])
  data = json.loads(out.read_text())
  runs = {run["variant"]: run for run in data["runs"]}
  assert list(runs) == ["ddp", "local@4@0.1:16"]
  assert runs["ddp"]["exchanges"] == 8 and runs["local@4@0.1:16"]["exchanges"] == 4  # syncs
  assert runs["local@4@0.1:16"]["bytes_sent"] < runs["ddp"]["bytes_sent"] / 5
  assert [p["step"] for p in runs["local@4@0.1:16"]["curve"]] == [0, 4, 8, 12, 16]

  report = _format.Report(tmp_path)
  section.language_model_section(report, data, _format.table, "language_model")
  text = "\n".join(report.parts)
  assert "| `local@4@0.1:16` | 16 |" in text and "steps to ddp's loss" in text
  size = runs["ddp"]["transmitted"] / runs["ddp"]["exchanges"]  # dense sends every parameter
  assert size == _parameters_of_the_quick_model()
  assert f"## Language model (docs corpus, {size / 1e6:.2g}M parameters)" in text
  assert (tmp_path / "language_model.png").exists()


def _parameters_of_the_quick_model() -> int:
  task = language_model_task("docs", context=16, width=16, layers=1, heads=2, test_windows=16)
  return sum(leaf.size for leaf in jax.tree.leaves(task.init_params(jax.random.key(0))))


def test_append_keeps_runs_made_with_the_same_settings_only(tmp_path):
  out = tmp_path / "language_model.json"
  out.write_text(json.dumps({"config": {"variants": "ddp,topk@0.01", "steps": 300},
                             "runs": [{"variant": "ddp"}, {"variant": "topk@0.01"}]}))
  config = {"variants": "topk@0.01,cltk@0.01", "steps": 300}
  assert language_model.earlier_runs(out, config) == [{"variant": "ddp"}, {"variant": "topk@0.01"}]
  assert config["variants"] == "ddp,topk@0.01,cltk@0.01"
  with pytest.raises(SystemExit, match=r"other settings \(steps\)"):
    language_model.earlier_runs(out, {"variants": "ddp", "steps": 900})


@pytest.mark.parametrize(("kind", "method", "role"), [
    ("sparse_adamw_topk_steered", "topk_steered", "sparse_adamw"),
    ("local_cltk", "cltk", "local"), ("sparse_adamw", "exdyna", "sparse_adamw"),
    ("topk", "topk", "topk")])
def test_a_variant_names_its_compressor_by_suffix(kind, method, role):
  assert language_model.compressor_of(kind) == (method, role)


def test_the_oracle_reference_sends_the_largest_of_the_mean_and_keeps_the_rest():
  rng = np.random.default_rng(0)
  updates = [{"a": rng.normal(size=(6, 5)), "b": rng.normal(size=10)} for _ in range(3)]
  tx = language_model.global_topk_feedback(0.1)  # k = 4 of 40
  state = tx.init(jax.tree.map(jnp.asarray, updates[0]))
  residual = np.zeros(40)
  for update in updates:
    sent, state = tx.update(jax.tree.map(jnp.asarray, update), state)
    accumulated = residual + np.concatenate([update["a"].ravel(), update["b"]])
    largest = np.argsort(-np.abs(accumulated))[:4]
    expected = np.zeros(40)
    expected[largest] = accumulated[largest]
    residual = accumulated - expected
    np.testing.assert_allclose(np.concatenate([sent["a"].ravel(), sent["b"]]), expected,
                               rtol=1e-6)


ARGS = argparse.Namespace(learning_rate=1e-2, warmup=1, clip=1.0, weight_decay=0.01)


def last_update(kind, rest, steps=1, lr_scale=1.0):
  """The variant's update at its ``steps``-th step, 8 workers under ``vmap``, one gradient each."""
  tx = language_model.optimizer(kind, rest, 4, ARGS, lr_scale)
  grads = jax.random.normal(jax.random.key(0), (8, 1, 64)).repeat(steps, axis=1)
  return harness.run_vmap(tx, jnp.ones(64), grads)[0][:, -1]


def test_the_oracle_of_every_element_is_the_recipe_sending_everything():
  np.testing.assert_allclose(last_update("sparse_adamw_oracle", ["1.0"]),
                             last_update("sparse_adamw_dense", []), rtol=1e-6)
  with pytest.raises(ValueError, match="unknown variant"):
    language_model.optimizer("sparse_adamw_typo", [], 4, ARGS)


def test_a_variant_may_scale_its_peak_rate():
  assert language_model.parse_variant("local@30@0.05@2xlr:900", 300) == (
      "local", ["30", "0.05"], 900, 2.0)
  assert language_model.parse_variant("ddp", 300) == ("ddp", [], 300, 1.0)
  # The second step's: the first is the warm-up's, at rate 0.
  np.testing.assert_allclose(last_update("sparse_adamw_dense", [], steps=2, lr_scale=2.0),
                             2 * last_update("sparse_adamw_dense", [], steps=2), rtol=1e-6)


@pytest.mark.parametrize("values", [["2"], []])
def test_a_per_step_variant_takes_its_values_after_the_density(values):
  """``sparse_adamw_chunked_topk@0.25@2`` sends what ``chunked_topk(0.25, value_bits=2)`` sends."""
  args = argparse.Namespace(**vars(ARGS), chunk=64)
  grads = jax.random.normal(jax.random.key(0), (8, 1, 64))

  def bytes_sent(tx):
    return int(exdyna_jax.get_stats(harness.run_vmap(tx, jnp.ones(64), grads)[2]).bytes_sent[0])

  variant = language_model.optimizer("sparse_adamw_chunked_topk", ["0.25", *values], 4, args)
  bits = {"value_bits": int(values[0])} if values else {}
  assert bytes_sent(variant) == bytes_sent(exdyna_jax.chunked_topk(0.25, chunk=64, **bits))


def test_a_density_may_warm_up_as_the_recipe_does():
  """``@0.02w2``: 12.5 %, then a quarter of it, for two steps each, then 0.02."""
  assert language_model.density_of("0.01") == 0.01
  assert language_model.density_of("0.02w2") == {0: 0.125, 2: 0.03125, 4: 0.02}
  args = argparse.Namespace(**vars(ARGS), chunk=64)
  grads = jax.random.normal(jax.random.key(0), (8, 5, 64))
  variant = language_model.optimizer("sparse_adamw_chunked_topk", ["0.02w2", "2"], 5, args)
  asked = exdyna_jax.get_stats(harness.run_vmap(variant, jnp.ones(64), grads)[1]).target[0]
  assert asked.tolist() == [8, 8, 2, 2, 1]  # of 64 a worker


def test_the_cluster_section_reads_each_demo_run_against_its_own_dense(tmp_path):
  """`benchmarks.cluster_lm` keeps each `exdyna-jax demo --processes 4` run whole; the REPORT
  gives every method its link, its recipe and its time to its own run's dense loss."""
  from benchmarks import cluster_lm
  from benchmarks.report import cluster_lm as cluster_section

  local = cluster_lm.recipes([10])["local steps, H = 10"]
  assert local[local.index("--sync-every") + 1] == "10" and "all_reduce" in local
  per_step = cluster_lm.recipes([10])["per step, d = 0.01"]  # the demo's AdamW recipes
  assert {"topk_union", "chunked_topk_2bit"} <= set(per_step) and "--sync-every" not in per_step

  def demo_run(rate, recipe, dense_seconds, method_seconds, method="chunked_topk"):
    def run(variant, seconds, losses, steps):
      curve = [(s, (i + 1) * steps // 2, loss, 0)
               for i, (s, loss) in enumerate(zip(seconds, losses, strict=True))]
      return {"variant": variant, "curve": curve, "steps": steps, "median_step_ms": 1.0,
              "higher_is_better": False, "metric": "test_loss", "num_elements": 10,
              "bytes_sent": 40 if variant == "dense" else 1}
    return {"recipe": recipe, "link_rate": rate,
            "command": f"exdyna-jax demo --link-rate {rate} --method {method} --density 1",
            "runs": [run("dense", dense_seconds, [3.0, 2.0], 20),
                     run(method, method_seconds, [2.5, 1.5], 200)]}

  data = {"task": "lm", "invocations": [demo_run("100mbit", "local", [30.0, 60.0], [10.0, 20.0]),
                                         demo_run("1gbit", "local", [20.0, 40.0], [5.0, 20.0]),
                                         demo_run("100mbit", "per step", [30.0, 60.0],
                                                  [20.0, 30.0], "exdyna")]}
  report = _format.Report(tmp_path)
  cluster_section.cluster_lm_section(report, data, _format.table)
  text = "\n".join(report.parts)
  assert "| 100mbit | local | chunked_topk | 200 | 1 | 1.5000 | 20.0 | 3.00x |" in text
  assert "| 1gbit | local | chunked_topk | 200 | 1 | 1.5000 | 20.0 | 2.00x |" in text
  assert "Each run: `exdyna-jax demo --link-rate RATE` and the recipe's arguments (local: " \
         "`--method chunked_topk --density 1`; per step: `--method exdyna --density 1`)" in text
  assert "![cluster_lm_100mbit.png](cluster_lm_100mbit.png)" in text  # one plot a rate
  assert (tmp_path / "cluster_lm_100mbit.png").exists()
  assert (tmp_path / "cluster_lm_1gbit.png").exists()
  # The goals: 10x sooner at 100 Mb/s (missed here), 3x at 1 Gb/s.
  assert [(row[1], row[2], row[3]) for row in report.targets] == [
      (">= 3", "2.00", "**missed**"), (">= 10", "3.00", "**missed**"), ("> 1", "1.50", "**met**")]
