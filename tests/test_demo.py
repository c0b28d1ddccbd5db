"""The demo: outputs, the table, and traffic counted from the compiled HLO."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from exdyna_jax import _cli, hlo
from exdyna_jax.demo import report
from tests import harness

pytestmark = pytest.mark.slow  # the tools end to end: `-m "not slow"` leaves them out

STEPS = 12
PLOTS = ("loss.png", "density_threshold.png", "partitions.png", "bytes.png")



@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  """One in-process CLI run, shared by the tests below."""
  run_dir = tmp_path_factory.mktemp("demo")
  code = _cli.main([
      "demo", "--method", "exdyna", "--density", "0.01", "--steps", str(STEPS),
      "--eval-every", "6", "--run-dir", str(run_dir), "--no-progress",
  ])
  assert code == 0
  return run_dir


def test_demo_writes_metrics_table_and_plots(demo_run, capsys):
  for method in ("dense", "exdyna"):
    records = report.read_json_lines(demo_run / f"metrics-{method}.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"loss", "density", "threshold", "partition_starts", "bytes_sent"} <= set(records[0])
    assert "test_accuracy" in records[5] and "test_accuracy" in records[-1]
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last < first, (method, first, last)
  for plot in PLOTS:
    assert (demo_run / plot).stat().st_size > 1000, plot
  table = (demo_run / "table.txt").read_text()
  assert table.splitlines()[1].split()[:4] == ["method", "test", "acc.", "vs"]
  assert table.splitlines()[3].startswith("dense") and table.splitlines()[4].startswith("exdyna")
  assert max(len(line) for line in table.splitlines()) <= 100


def test_the_wide_table_adds_the_compiled_bytes_and_the_spread_of_sent_over_k(demo_run):
  summaries = json.loads((demo_run / "summary.json").read_text())["summaries"]
  narrow = report.format_table(summaries, "test_accuracy").splitlines()
  wide = report.format_table(summaries, "test_accuracy", wide=True).splitlines()
  assert "bytes (HLO)" in wide[0] and "med |sent/k-1|" in wide[0]
  assert "bytes (HLO)" not in narrow[0] and len(wide[0]) > len(narrow[0])
  exdyna = next(row for row in summaries if row["method"] == "exdyna")
  assert report.format_bytes(exdyna["hlo_bytes"]) in wide[3]


def test_the_summary_reads_sent_over_k_and_overflow_once_the_threshold_is_found():
  """The first steps look for the threshold (a first guess may pass every element): sent/k and
  the overflow a step are read over the exchanges after the first 20."""
  records = [{"loss": 1.0, "density": 0.01, "sent_over_k": 3.0 if step < 3 else 1.0,
              "overflow": 10_000 if step < 3 else 2, "bytes_sent": 100, "step_time_s": 0.01}
             for step in range(30)]
  run = SimpleNamespace(method="topk_union", records=records, final_metrics={}, hlo_bytes=100,
                        num_elements=1000, target=10)
  summary = report.summarize(run, 1000)
  assert (summary["sent_over_k"], summary["overflow_per_step"]) == (1.0, 2)


def test_printed_traffic_ratio_is_the_compiled_programs(demo_run):
  summary = json.loads((demo_run / "summary.json").read_text())
  rows = {row["method"]: row for row in summary["summaries"]}
  for method, row in rows.items():
    collectives = [hlo.Collective(**c) for c in summary["collectives"][method]]
    compiled = round(sum(c.bytes_sent for c in collectives))
    assert row["hlo_bytes"] == compiled
    # The library's own count (control counts included) is what XLA compiled.
    assert row["stats_bytes"] == compiled, (method, row)
  assert rows["dense"]["ratio_to_dense"] == 1.0
  ratio = rows["exdyna"]["hlo_bytes"] / rows["dense"]["hlo_bytes"]
  assert rows["exdyna"]["ratio_to_dense"] == pytest.approx(ratio)
  assert 0.01 < ratio < 0.05  # 1 % of the indices and values, with 1.5x buffers
  assert f"{ratio:.3%}" in (demo_run / "table.txt").read_text()
  # No dense all-reduce hides in the ExDyna step: nothing gradient-sized.
  num_elements = rows["exdyna"]["num_elements"]
  for c in summary["collectives"]["exdyna"]:
    assert sum(dims[0] if dims else 1 for _, dims in c["shapes"]) < num_elements // 10


def test_density_warmup_and_bf16_values_from_the_command_line(tmp_path):
  """--density-warmup 2: 25 %, 6.25 %, 1.5625 % for two steps each, then 1 %; the bytes
  each step follow the level, and the table's bytes are the mean of what was sent."""
  code = _cli.main([
      "demo", "--density", "0.01", "--steps", "8", "--density-warmup", "2",
      "--value-dtype", "bfloat16", "--eval-every", "8", "--run-dir", str(tmp_path),
      "--no-progress", "--no-plots",
  ])
  assert code == 0
  records = report.read_json_lines(tmp_path / "metrics-exdyna.jsonl")
  sent = [r["bytes_sent"] for r in records]
  assert sent[0] == sent[1] > sent[2] == sent[3] > sent[4] == sent[5] > sent[6] == sent[7]
  assert 0.2 < records[0]["density"] <= 0.25 * 1.1
  # Against each step's level, from its second step (the first re-measures the threshold).
  assert all(0.9 < r["sent_over_k"] <= 1.11 for r in records[1::2])  # <= ceil(1.1 k) slots
  summary = json.loads((tmp_path / "summary.json").read_text())["summaries"][1]
  assert summary["stats_bytes"] == pytest.approx(sum(sent) / len(sent))


def test_cli_help_and_bad_arguments(capsys):
  with pytest.raises(SystemExit) as exit_info:
    _cli.main(["demo", "--help"])
  assert exit_info.value.code == 0
  help_text = capsys.readouterr().out
  for flag in ("--method", "--density", "--steps", "--warmup-steps", "--run-dir"):
    assert flag in help_text
  with pytest.raises(SystemExit):
    _cli.main(["demo", "--method", "nope"])
  assert "unknown method" in capsys.readouterr().err
  # Names as get_sparsifier takes them: case, "-" and "_" ignored.
  assert _cli.build_parser().parse_args(["demo", "--method", "Top-K"]).method == ["topk"]
  with pytest.raises(SystemExit):
    _cli.main(["demo", "--density", "2"])
  with pytest.raises(SystemExit):
    _cli.main(["demo", "--density-warmup", "-1"])
  with pytest.raises(SystemExit):
    _cli.main(["demo", "--value-dtype", "int8"])
  # The network ExDyna is told: two positive numbers, or timed by the workers.
  args = _cli.build_parser().parse_args(["demo", "--network", "1e-3,1.25e8"])
  assert args.network == (1e-3, 1.25e8)
  assert _cli.build_parser().parse_args(["demo", "--network", "measure"]).network == "measure"
  for bad in ("1e-3", "0,1e8", "1e-3,inf", "fast,slow", "measured"):
    with pytest.raises(SystemExit):
      _cli.main(["demo", "--network", bad])
    assert "SECONDS,BYTES_PER_SECOND" in capsys.readouterr().err
  # --workers is the one-process run's: with --processes it would be ignored.
  with pytest.raises(SystemExit):
    _cli.main(["demo", "--workers", "3", "--processes", "2"])
  assert "with --processes each process is one worker: drop --workers" in capsys.readouterr().err


def test_python_dash_m_entry_point():
  result = subprocess.run(
      [sys.executable, "-m", "exdyna_jax", "demo", "--help"],
      capture_output=True, text=True, timeout=60, check=True,
  )
  assert "exdyna-jax demo" in result.stdout


def test_plots_show_each_partitions_share_and_the_bytes_against_dense():
  """partitions.png: size over N/n per partition and step (a heat map, its colour scale as
  wide as the data) and its median; bytes.png: a bar per method at its mean bytes on a linear
  axis from 0, the compiled count marked, 1/x of dense."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sizes = [[10, 30, 40, 20], [20, 20, 40, 20], [10, 10, 60, 20]]
  run = SimpleNamespace(method="exdyna", hlo_bytes=1200,
                        records=[{"step": s + 1, "partition_sizes": z, "bytes_sent": 1000 + s}
                                 for s, z in enumerate(sizes)])
  fig, (ax_map, ax_median) = plt.subplots(1, 2)
  report.plot_partition_shares(fig, ax_map, ax_median, run)
  shares = ax_map.get_images()[0].get_array()
  assert shares.shape == (4, 3)  # a row per partition, a column per step
  assert shares[2].tolist() == [40 * 4 / 100, 40 * 4 / 100, 60 * 4 / 100]
  assert [bar.get_width() for bar in ax_median.patches] == [0.4, 0.8, 1.6, 0.8]
  low, high = ax_map.get_images()[0].norm.vmin, ax_map.get_images()[0].norm.vmax
  assert (low, high) == (1 / 4, 4)  # shares in [0.4, 2.4]: 1/4 to 4, not 1/1024 to 1024
  dense = SimpleNamespace(method="dense", hlo_bytes=50_000,
                          records=[{"bytes_sent": 50_000}] * 3)
  fig, ax = plt.subplots()
  report.plot_bytes(ax, [dense, run])
  assert sorted(bar.get_width() for bar in ax.patches) == [1001.0, 50_000.0]
  labels = [text.get_text() for text in ax.texts]
  assert any("1/50 of dense" in label for label in labels), labels
  assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0  # lengths in proportion
  # A worker alone (one GPU) sends nothing: a linear axis, no warning.
  alone = [SimpleNamespace(method=r.method, hlo_bytes=0, records=[{"bytes_sent": 0}])
           for r in (dense, run)]
  fig, ax = plt.subplots()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    report.plot_bytes(ax, alone)
  assert ax.get_xscale() == "linear"
  plt.close("all")


def test_the_lm_tasks_default_to_adamw_and_sync_every_reaches_the_config():
  args = _cli.build_parser().parse_args(["demo", "--task", "lm", "--sync-every", "30"])
  config = _cli._demo_config(args, task="lm", steps=300, eval_every=25)
  assert (config.optimizer, config.learning_rate, config.batch_per_worker) == ("adamw", 6e-3, 8)
  assert config.sync_every == 30 and config.steps == 300
  args = _cli.build_parser().parse_args(["demo", "--learning-rate", "0.1"])
  config = _cli._demo_config(args, task="digits", steps=500, eval_every=25)
  assert (config.optimizer, config.learning_rate, config.sync_every) == ("sgd", 0.1, 1)


def test_value_bits_and_the_wire_reach_chunked_topk_and_are_refused_elsewhere(capsys):
  """``--value-bits 2 --wire all_reduce --density 1``: the demo's chunked_topk is the library's
  quantized all-reduce, the owners' means in 2 bits too; the options without chunked_topk, or a
  combination it refuses, are usage errors before any training."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import exdyna_jax
  from exdyna_jax.demo import recipes

  argv = ["demo", "--method", "chunked_topk", "--density", "1", "--value-bits", "2", "--wire",
          "all_reduce"]
  config = _cli._demo_config(_cli.build_parser().parse_args(argv), task="lm", steps=9,
                             eval_every=3)
  assert (config.value_bits, config.wire) == (2, "all_reduce")
  grads = jax.random.normal(jax.random.key(0), (4, 2, 5000))
  updates, states, _ = harness.run_vmap(recipes.sparsifier_for("chunked_topk", config),
                                        jnp.zeros(5000), grads)
  expected, expected_states, _ = harness.run_vmap(exdyna_jax.chunked_topk(
      1.0, value_bits=2, wire="all_reduce", mean_bits=2), jnp.zeros(5000), grads)
  np.testing.assert_array_equal(updates, expected)
  np.testing.assert_array_equal(states.stats.bytes_sent, expected_states.stats.bytes_sent)
  for bad, message in (
      (["--value-bits", "2"], "are chunked_topk's options: add --method chunked_topk"),
      (["--method", "chunked_topk", "--wire", "all_reduce", "--value-bits", "2"],
       "--method chunked_topk: wire='all_reduce' sends every element"),
      (["--method", "chunked_topk", "--value-bits", "3"], "invalid choice: 3")):
    with pytest.raises(SystemExit) as exit_info:
      _cli.main(["demo", *bad])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
  parser = _cli.build_parser()  # the network ExDyna is told is measured later: no error
  _cli._check_method_options(parser, parser.parse_args(["demo", "--network", "measure"]))


@pytest.mark.parametrize("task, optimizer, rate", [
    ("digits", "sgd", 0.3), ("digits", "adamw", 3e-3), ("lm", "sgd", 0.3),
    ("lm-code", "adamw", 6e-3)])
def test_the_default_learning_rate_is_the_optimizers_own(task, optimizer, rate):
  """SGD's rate of 0.3 as AdamW's peak left the digits at 80 % and the AdamW recipe at 19 %;
  each optimizer has its own default on each task."""
  args = _cli.build_parser().parse_args(["demo", "--task", task, "--optimizer", optimizer])
  config = _cli._demo_config(args, task=task, steps=500, eval_every=25)
  assert (config.optimizer, config.learning_rate) == (optimizer, rate)


def _tiny_lm_run(method: str, **overrides):
  """``method`` on a one-block byte-level LM under AdamW (density 0.04 and 5 steps unless
  ``overrides`` say otherwise), every device a worker: the run and the worker count."""
  import jax

  from exdyna_jax.demo import language_model, recipes, trainer

  task = language_model.language_model_task(context=16, width=16, layers=1, heads=2,
                                            test_windows=8)
  config = recipes.TrainConfig(**{
      "steps": 5, "density": 0.04, "batch_per_worker": 2, "learning_rate": 3e-3,
      "warmup_steps": 2, "eval_every": 5, "optimizer": "adamw", **overrides})
  workers = jax.device_count()
  return trainer.train_method(method, task, config, trainer.make_mesh(workers)), workers


def test_local_steps_of_adamw_on_the_language_model_record_their_syncs():
  """The demo's trainer on a small `lm` model, ExDyna local steps of AdamW exchanging the
  pseudo-gradient every 2 steps: local steps send nothing and carry no sent/k."""
  run, _ = _tiny_lm_run("exdyna", steps=6, density=0.05, eval_every=3, sync_every=2)
  assert [r["sent_over_k"] is not None for r in run.records] == [False, True] * 3
  assert [r["bytes_sent"] > 0 for r in run.records] == [False, True] * 3
  assert all(r["overflow"] == 0 for r in run.records[::2])
  assert 0.5 < run.records[-1]["sent_over_k"] < 1.5
  assert run.records[-1]["test_loss"] < run.records[2]["test_loss"]  # it learns
  summary = report.summarize(run, None)
  assert summary["density"] < 0.05 * 1.5 / 2  # a sync's density, every second step


def test_topk_union_shares_the_density_among_the_workers():
  """``topk_union`` (the AdamW recipe): each worker picks ``floor(d / n * N)`` by its steered
  threshold; sent/k is the union over the ``n`` workers' ``k``, so about 1 at most."""
  from exdyna_jax.demo import recipes

  parse = _cli.build_parser().parse_args
  assert parse(["demo", "--method", "TopK-Union"]).method == ["topk_union"]
  run, workers = _tiny_lm_run("topk_union")
  k = int(0.04 / workers * run.num_elements)
  assert run.target == workers * k
  # The thresholds start low and reach their counts within two steps.
  assert all(0.7 < r["sent_over_k"] <= 1.15 for r in run.records[2:]), run.records
  assert recipes.per_worker({0: 0.25, 10: 0.04}, 4) == {0: 0.0625, 10: 0.01}


def test_the_2bit_recipe_sends_six_shares_after_a_warmup_and_is_the_lm_tasks_default():
  """``chunked_topk_2bit``: each worker its own ``6 d / n`` in 2 bits (at most every element),
  after levels of 12.5 %, then a quarter of it, ten steps each; the ``k`` asked is the
  workers' together."""
  import exdyna_jax
  from exdyna_jax.demo import recipes

  parse = _cli.build_parser().parse_args
  assert _cli.demo_methods_of(parse(["demo", "--task", "lm"])) == ["exdyna", "chunked_topk_2bit"]
  assert _cli.demo_methods_of(parse(["demo"])) == ["exdyna"]
  assert parse(["demo", "--method", "Chunked-TopK-2bit"]).method == ["chunked_topk_2bit"]
  assert recipes.per_worker(0.01, 4, shares=6) == pytest.approx(0.015)
  assert recipes.per_worker({0: 0.5, 10: 0.01}, 2, shares=6) == {0: 1.0, 10: 0.03}
  assert recipes.two_bit_density(recipes.TrainConfig(density=0.01), 8) == {
      0: 0.125, 10: 0.03125, 20: 0.0078125, 30: 0.0075}
  assert recipes.two_bit_density(recipes.TrainConfig(density=0.25), 8) == 0.1875  # no warm-up
  run, workers = _tiny_lm_run("chunked_topk_2bit", steps=3, eval_every=3, density_warmup=1)
  levels = exdyna_jax.dgc_warmup(6 * 0.04 / workers, steps_per_level=1, start=0.125).values()
  assert [r["target"] for r in run.records] == [
      workers * int(level * run.num_elements) for level in levels]
  assert all(0 < r["sent_over_k"] <= 1 for r in run.records), run.records


def test_the_cluster_plans_a_run_from_the_steps_after_the_density_warmup():
  """The cluster times a variant's step once its warm-up is over (`recipes.warmup_steps`): the
  first step of its last level, which under local steps counts syncs."""
  from exdyna_jax.demo import recipes

  config = recipes.TrainConfig(density=0.01)
  assert recipes.warmup_steps("chunked_topk_2bit", config, 8) == 30  # {..., 30: 0.0075}
  assert recipes.warmup_steps("chunked_topk_2bit", config, 4) == 20  # 0.0078 < 0.015: no 30
  assert recipes.warmup_steps("exdyna", config, 8) == 0
  warmed = dataclasses.replace(config, density_warmup=25)  # 25 %, 6.25 %, 1.6 %, then 1 %
  assert recipes.warmup_steps("exdyna", warmed, 8) == 75
  assert recipes.warmup_steps("dense", warmed, 8) == 0
  local = dataclasses.replace(warmed, sync_every=10)
  assert recipes.warmup_steps("exdyna", local, 8) == 750


def test_under_momentum_sgd_the_2bit_method_runs_the_momentum_sgd_recipe():
  """docs/usage.md's momentum-SGD recipe: each worker's gradient clipped, the 2-bit sparsifier,
  no momentum after it and the rate over (1 - momentum); the other methods keep the chain."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import exdyna_jax
  from exdyna_jax.demo import recipes

  config = recipes.TrainConfig(steps=10, density=0.5, learning_rate=0.1, momentum=0.9,
                               warmup_steps=2)
  sparsifier = exdyna_jax.chunked_topk(6 * config.density / 8, value_bits=2,
                                       axis_name=recipes.AXIS)
  recipe = optax.chain(optax.clip_by_global_norm(1.0), sparsifier,
                       optax.sgd(optax.linear_schedule(0.0, 0.1 / (1 - 0.9), 2)))
  grads = 10 * jax.random.normal(jax.random.key(0), (8, 3, 64))  # norms above 1: clipped

  def updates(tx):
    return harness.run_vmap(tx, jnp.ones(64), grads)[0]

  np.testing.assert_allclose(updates(recipes.optimizer_for("chunked_topk_2bit", config, 8)),
                             updates(recipe), rtol=1e-6)
  assert np.abs(updates(recipe)[:, 1:]).max() > 0
  chain = recipes.optimizer_for("exdyna", config, 8)  # the chain --momentum documents
  state = jax.vmap(chain.init, in_axes=None, axis_name=recipes.AXIS, axis_size=8)(jnp.ones(64))
  assert optax.tree.get(state, "trace") is not None


@pytest.mark.parametrize("method", ["topk_union", "chunked_topk_2bit", "chunked_topk"])
def test_under_adamw_the_per_step_recipes_run_at_twice_the_peak_rate(method):
  """docs/usage.md's advice: the AdamW recipes, per step, at twice dense's peak."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import exdyna_jax
  from exdyna_jax.demo import recipes

  config = recipes.TrainConfig(steps=10, density=0.5, learning_rate=1e-2, warmup_steps=2,
                               optimizer="adamw", value_bits=2)
  peak = 2 * config.learning_rate
  sparsifier = {
      "topk_union": exdyna_jax.topk(config.density / 8, exact=False, axis_name=recipes.AXIS),
      "chunked_topk_2bit": exdyna_jax.chunked_topk(6 * config.density / 8, value_bits=2,
                                                   axis_name=recipes.AXIS),
      "chunked_topk": exdyna_jax.chunked_topk(config.density, value_bits=2,
                                              axis_name=recipes.AXIS)}[method]
  recipe = optax.chain(optax.clip_by_global_norm(1.0), exdyna_jax.sparse_adamw(
      sparsifier, optax.warmup_cosine_decay_schedule(0.0, peak, 2, 10, peak / 10),
      weight_decay=0.01))
  grads = jax.random.normal(jax.random.key(0), (8, 1, 64)).repeat(2, axis=1)

  def second_update(tx):  # the first is the warm-up's, at rate 0
    return harness.run_vmap(tx, jnp.ones(64), grads)[0][:, 1]

  np.testing.assert_allclose(second_update(recipes.optimizer_for(method, config, 8)),
                             second_update(recipe), rtol=1e-6)
  assert np.abs(second_update(recipe)).max() > 0


def test_a_loss_is_reached_at_or_below_denses_and_an_accuracy_at_or_above():
  from exdyna_jax.demo import cluster

  run = {"curve": [(1.0, 10, 3.0, 0), (2.0, 20, 2.0, 0)], "higher_is_better": False}
  assert cluster.time_to_target(run, 2.5) == 2.0 and cluster.time_to_target(run, 1.0) is None
  assert cluster.time_to_target({**run, "higher_is_better": True}, 2.5) == 1.0
  # Dense's final score averages its last three evaluations in its last tenth of steps only.
  curve = [(1.0, step, 3.0 - step / 100, 0) for step in (50, 100, 150, 180, 190, 200)]
  assert cluster.dense_target([{"variant": "dense", "curve": curve, "steps": 200}]) == (
      pytest.approx(1.1))
  coarse = [point for point in curve if point[1] % 50 == 0]
  assert cluster.dense_target([{"variant": "dense", "curve": coarse, "steps": 200}]) == 1.0
  assert cluster.score_name({**run, "metric": "test_loss"}) == "test loss"
  assert cluster.score_name({"curve": []}) == "test acc."  # runs recorded before the field
