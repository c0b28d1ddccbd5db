"""The demo across worker processes behind shaped links: time to accuracy.

``exdyna-jax demo --processes 4 --link-rate 1gbit`` runs
`exdyna_jax.demo.cluster_worker` as 4 JAX processes (``exdyna_jax.launch``),
each in a network namespace of its own behind a link shaped to 1 Gb/s both
ways. Dense trains ``config.steps`` steps; every other method trains for as
many wall-clock seconds, its learning-rate schedule spanning the steps that
fit them at the step time it measured after its density warm-up (as a user
given those seconds would set it). The table says when each method first
reached dense's final score (test accuracy; test loss for the ``lm``
tasks), beside the density it sent and its bytes; the plot draws the score
against seconds.

From Python (as root, or in an unprivileged user namespace)::

  from exdyna_jax.demo import cluster
  result = cluster.run_cluster_demo(["exdyna"], processes=4, link_rate="1gbit")
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import sys
import textwrap
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, TextIO

from exdyna_jax import launch
from exdyna_jax.demo import report
from exdyna_jax.demo.recipes import TrainConfig

__all__ = ["ClusterDemoResult", "WorkerRecords", "dense_target", "run_cluster_demo",
           "run_workers", "time_to_target"]

WORKER_MODULE = "exdyna_jax.demo.cluster_worker"
DEFAULT_TASK = "digits-wide"
DEFAULT_TIMEOUT = 1800.0


class WorkerRecords(io.TextIOBase):
  """A stdout for `launch.launch`: keeps rank 0's JSON lines, echoes the rest.

  Attributes:
    records: the JSON objects rank 0 printed, in order.
  """

  def __init__(self, echo: TextIO | None = None):
    self.records: list[dict[str, Any]] = []
    self._echo = sys.stderr if echo is None else echo
    self._lock = threading.Lock()

  def write(self, text: str) -> int:
    for line in text.splitlines():
      if line.startswith("[rank 0] {"):
        with self._lock:
          self.records.append(json.loads(line.split(" ", 2)[2]))
      elif line.strip() and "[Gloo]" not in line:  # gloo's connection chatter
        print(line, file=self._echo)
    return len(text)


def run_workers(command: Sequence[str], *, processes: int, link_rate: str | None,
                devices_per_process: int = 1, timeout: float = DEFAULT_TIMEOUT,
                echo: TextIO | None = None) -> list[dict[str, Any]]:
  """Runs ``command`` as ``processes`` JAX processes on their shares of the CPUs: rank 0's records.

  Each process keeps to its own CPUs (`launch.launch`'s ``pin_cpus``), as a
  worker on a machine of its own would: unpinned, processes that outnumber
  the cores starve one another for up to seconds at a time, and the others
  wait for them at their next collective.

  Args:
    command: the worker's command line.
    processes: JAX processes.
    link_rate: each process's link (`launch.launch`'s ``link_rates``); None:
      every process on 127.0.0.1, no namespaces.
    devices_per_process: CPU devices of each process.
    timeout: seconds after which every process is killed.
    echo: where the workers' other lines go (default ``sys.stderr``).

  Returns:
    The JSON objects rank 0 printed, one per line.

  Raises:
    PermissionError: shaped links without the privileges (says what to do).
    RuntimeError: a worker failed or the run timed out.
  """
  echo = sys.stderr if echo is None else echo
  sink = WorkerRecords(echo)
  code = launch.launch(list(command), processes=processes,
                       devices_per_process=devices_per_process, timeout=timeout,
                       link_rates=link_rate, stdout=sink, stderr=echo, pin_cpus=True)
  if code:
    raise RuntimeError(f"the workers failed (exit code {code}): {processes} processes, "
                       f"links {link_rate or 'loopback'}")
  return sink.records


def time_to_target(run: dict[str, Any], target: float) -> float | None:
  """Seconds at ``run``'s first evaluation that reached ``target``, or None.

  Reached: at or above it where a higher score is better (accuracy), at or
  below it otherwise (loss).
  """
  sign = 1 if run.get("higher_is_better", True) else -1
  return next((point[0] for point in run["curve"] if sign * point[2] >= sign * target), None)


def dense_target(runs: Sequence[dict[str, Any]]) -> float:
  """Dense's final score: the mean of its last three evaluations in its last tenth of steps.

  The tenth keeps a coarse ``eval_every`` from averaging in scores of the
  middle of the run (its final evaluation is always in).
  """
  dense = next(run for run in runs if run["variant"] == "dense")
  last = [point[2] for point in dense["curve"] if point[1] >= 0.9 * dense["steps"]][-3:]
  last = last or [dense["curve"][-1][2]]
  return sum(last) / len(last)


def summary_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
  """The table's rows: when each variant reached dense's score, what it sent."""
  target = dense_target(runs)
  dense = next(run for run in runs if run["variant"] == "dense")
  dense_time = time_to_target(dense, target)
  rows = []
  for run in runs:
    reached = time_to_target(run, target)
    sent = [point[3] for point in run["curve"]]
    rows.append({
        "method": run["variant"],
        "steps": str(run["steps"]),
        "step ms": f"{run['median_step_ms']:.0f}",
        score_name(run): (f"{run['curve'][-1][2]:.2%}" if run.get("higher_is_better", True)
                          else f"{run['curve'][-1][2]:.4f}"),
        "s to dense's": "not reached" if reached is None else f"{reached:.1f}",
        "sooner": "" if reached is None or dense_time is None else f"{dense_time / reached:.2f}x",
        "density": f"{sum(sent) / len(sent) / run['num_elements']:.3%}",
        "bytes/step": report.format_bytes(run["bytes_sent"]),
        "vs dense": f"1/{dense['bytes_sent'] / run['bytes_sent']:.0f}",
    })
  return rows


def score_name(run: dict[str, Any]) -> str:
  """The table's name of ``run``'s score (runs recorded before the field: test accuracy)."""
  return run.get("metric", "test_accuracy").replace("_", " ").replace("accuracy", "acc.")


def told_network(asked: Sequence[float] | str | None, used: Sequence[float] | None) -> str:
  """What ExDyna was told of the network, in words ("" if nothing).

  Args:
    asked: `TrainConfig.network`: a pair, ``"measure"`` or None.
    used: the pair the workers built ExDyna with (what they measured), or
      None where a run did not record it (then ``asked``).
  """
  if asked is None:
    return ""
  seconds, bytes_per_second = asked if used is None else used
  how = "measured" if asked == "measure" else "given"
  return (f"ExDyna told the network ({how}): {1e3 * seconds:.2g} ms a message, "
          f"{8 * bytes_per_second / 1e9:.2g} Gb/s")


def plot_curves(runs: Sequence[dict[str, Any]], path: pathlib.Path, title: str) -> pathlib.Path:
  """The score (test accuracy, loss) against wall-clock seconds, one line per variant; dense's
  final score dotted, a star where each variant first reaches it.

  The score axis spans the later two thirds of every curve and the target,
  so the differences near the target are what fills the plot.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  target = dense_target(runs)
  fig, ax = plt.subplots(figsize=(7, 4))
  for run in runs:
    seconds, _, score, _ = zip(*run["curve"], strict=True)
    reached = time_to_target(run, target)
    when = "not reached" if reached is None else f"reached at {reached:.0f} s"
    (line,) = ax.plot(seconds, score, marker="o", ms=2, label=f"{run['variant']} ({when})",
                      color="k" if run["variant"] == "dense" else None)
    if reached is not None:
      ax.plot(reached, target, marker="*", ms=12, color=line.get_color(), zorder=3)
  ax.axhline(target, color="k", ls=":", lw=1, label="dense's final score (star: reached)")
  later = [point[2] for run in runs for point in run["curve"][len(run["curve"]) // 3:]]
  low, high = min([*later, target]), max([*later, target])
  margin = 0.08 * (high - low) or 0.01
  ax.set(xlabel="wall-clock seconds of training (evaluation excluded)",
         ylabel=score_name(runs[0]).replace("acc.", "accuracy"), title=title,
         ylim=(low - margin, high + margin))
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


class ClusterDemoResult(NamedTuple):
  """What `run_cluster_demo` produced.

  Attributes:
    run_dir: the directory holding every output.
    runs: one record per method (dense first): ``curve`` of ``(seconds,
      step, score, transmitted)`` points (the score: the task's first
      metric, ``metric``, better higher where ``higher_is_better``),
      ``steps``, ``seconds``, ``bytes_sent`` per worker per step (the run's
      mean), ``num_elements``.
    table: the printed table.
    plot: the PNG path, or None.
  """

  run_dir: pathlib.Path
  runs: list[dict[str, Any]]
  table: str
  plot: pathlib.Path | None


def run_cluster_demo(
    methods: Sequence[str] = ("exdyna",),
    *,
    processes: int = 4,
    link_rate: str = "1gbit",
    task: str = DEFAULT_TASK,
    config: TrainConfig | None = None,
    run_dir: pathlib.Path | str | None = None,
    plots: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    out: TextIO | None = None,
) -> ClusterDemoResult:
  """Trains dense, then each method for dense's seconds, on shaped links; compares.

  Args:
    methods: registry names to compare with ``dense`` (which runs first); a
      name ending in ``_warmup`` adds a DGC density warm-up.
    processes: JAX processes, one CPU device each.
    link_rate: each process's link in tc's notation (``"1gbit"``,
      ``"unshaped"``, or one per process, comma-separated).
    task: a name in `exdyna_jax.demo.tasks.TASKS`.
    config: the `TrainConfig`; ``steps`` is dense's.
    run_dir: output directory (default ``runs/cluster-<rate>-<time>``).
    plots: write ``time_to_accuracy.png``.
    timeout: seconds after which every process is killed.
    out: where to print the table (default ``sys.stdout``).

  Returns:
    The `ClusterDemoResult`.

  Raises:
    PermissionError: without the privileges network namespaces need (the
      message says how to run it).
  """
  from exdyna_jax.demo import default_run_dir

  out = sys.stdout if out is None else out
  config = TrainConfig() if config is None else config
  variants = list(dict.fromkeys(["dense", *methods]))
  run_dir = pathlib.Path(run_dir) if run_dir is not None else default_run_dir(
      f"cluster-{link_rate.replace(',', '_')}", config)
  run_dir.mkdir(parents=True, exist_ok=True)
  command = [sys.executable, "-m", WORKER_MODULE, f"--task={task}",
             f"--variants={','.join(variants)}",
             f"--config={json.dumps(dataclasses.asdict(config))}"]
  runs = run_workers(command, processes=processes, link_rate=link_rate, timeout=timeout)
  dense_steps = next(run["steps"] for run in runs if run["variant"] == "dense")
  header = (f"{task}: {runs[0]['num_elements']:,} parameters, {processes} processes, links "
            f"{link_rate}, density {config.density:g};\n{dense_steps} steps of dense, the others "
            "as many seconds (their schedules over the steps that fit)")
  told = told_network(config.network, runs[0].get("network"))
  header += f";\n{told}" if told else ""
  legend = (f"s to dense's = wall-clock seconds to dense's final {score_name(runs[0])}; "
            "density = indices sent / N (at each evaluation); bytes per worker, the run's "
            "mean per step.")
  table = "\n".join([header, report.format_rows(summary_rows(runs)), *textwrap.wrap(legend, 100)])
  print(f"\n{table}", file=out)
  (run_dir / "table.txt").write_text(table + "\n")
  (run_dir / "runs.json").write_text(json.dumps(
      {"task": task, "processes": processes, "link_rate": link_rate,
       "config": dataclasses.asdict(config), "runs": runs}, indent=2))
  plot = plot_curves(runs, run_dir / "time_to_accuracy.png", f"{task}, {processes} processes "
                     f"at {link_rate}") if plots else None
  print(f"table, runs and plot in {run_dir}/", file=out)
  return ClusterDemoResult(run_dir, runs, table, plot)
