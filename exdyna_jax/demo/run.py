"""The demo's main logic: train dense and each method, print the table, write the outputs."""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, TextIO

from exdyna_jax.demo import report, tasks
from exdyna_jax.demo.recipes import TrainConfig, with_measured_network
from exdyna_jax.demo.trainer import MethodRun, make_mesh, train_method

DEFAULT_RUNS_ROOT = pathlib.Path("runs")


class DemoResult(NamedTuple):
  """What `run_demo` produced.

  Attributes:
    run_dir: the directory holding every output.
    runs: the `MethodRun` of each method, dense first.
    summaries: one `report.summarize` dict per method, in the same order.
    table: the printed comparison table.
    plots: paths of the written PNG files.
  """

  run_dir: pathlib.Path
  runs: list[MethodRun]
  summaries: list[dict[str, Any]]
  table: str
  plots: list[pathlib.Path]


def default_run_dir(task: str, config: TrainConfig) -> pathlib.Path:
  """``runs/<task>-d<density>-<timestamp>``."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  return DEFAULT_RUNS_ROOT / f"{task}-d{config.density:g}-{stamp}"


def _progress_bar(enabled: bool):
  if not enabled:
    return None
  from tqdm import tqdm

  def wrap(iterator, description, total):
    return tqdm(iterator, desc=f"{description:>14}", total=total, unit="step",
                dynamic_ncols=True, leave=True)

  return wrap


def run_demo(
    methods: Sequence[str] = ("exdyna",),
    *,
    task: str = "digits",
    config: TrainConfig | None = None,
    workers: int = 8,
    run_dir: pathlib.Path | str | None = None,
    progress: bool = True,
    plots: bool = True,
    wide: bool = False,
    out: TextIO | None = None,
) -> DemoResult:
  """Trains ``task`` with ``dense`` and with each of ``methods``; compares them.

  Every method starts from the same parameters and sees the same batches;
  only the gradient exchange differs.

  Args:
    methods: registry names to compare against ``dense`` (which always runs
      first), e.g. ``["exdyna", "topk"]``.
    task: a name in `tasks.TASKS`.
    config: the `TrainConfig` (defaults: 500 steps at density 0.01).
    workers: data-parallel workers (JAX needs at least this many devices).
    run_dir: output directory (default: `default_run_dir`).
    progress: show a progress bar per run (on stderr).
    plots: write the PNG plots.
    wide: print every column of the table (the default fits 100 columns;
      ``summary.json`` holds every figure either way).
    out: where to print the table (default ``sys.stdout``).

  Returns:
    The `DemoResult`.
  """
  out = sys.stdout if out is None else out
  config = TrainConfig() if config is None else config
  if task not in tasks.TASKS:
    raise ValueError(f"Unknown task {task!r}; valid tasks: {', '.join(sorted(tasks.TASKS))}.")
  ordered = ["dense", *dict.fromkeys(m.lower().replace("-", "_") for m in methods)]
  ordered = list(dict.fromkeys(ordered))
  run_dir = pathlib.Path(run_dir) if run_dir is not None else default_run_dir(task, config)
  run_dir.mkdir(parents=True, exist_ok=True)
  mesh = make_mesh(workers)
  config = with_measured_network(config, mesh)
  (run_dir / "config.json").write_text(json.dumps(
      {"task": task, "methods": ordered, "workers": workers, **dataclasses.asdict(config)},
      indent=2))

  the_task = tasks.TASKS[task]()
  runs = []
  for method in ordered:
    writer = report.JsonLinesWriter(run_dir / f"metrics-{method}.jsonl")
    try:
      runs.append(train_method(method, the_task, config, mesh,
                               progress=_progress_bar(progress), on_record=writer.write))
    finally:
      writer.close()

  metric = next(iter(runs[0].final_metrics))
  dense_bytes = runs[0].hlo_bytes
  summaries = [report.summarize(run, dense_bytes) for run in runs]
  table = report.format_table(summaries, metric, wide=wide)
  header = (f"{task}: {runs[0].num_elements:,} parameters, {workers} workers, "
            f"{config.steps} steps, density {config.density:g}")
  print(f"\n{header}\n{table}", file=out)
  (run_dir / "table.txt").write_text(f"{header}\n{table}\n")
  (run_dir / "summary.json").write_text(json.dumps(
      {"summaries": summaries,
       "collectives": {run.method: [c._asdict() for c in run.collectives] for run in runs}},
      indent=2))
  written = report.plot_runs(runs, metric, run_dir) if plots else []
  print(f"metrics, plots and summary in {run_dir}/", file=out)
  return DemoResult(run_dir, runs, summaries, table, written)
