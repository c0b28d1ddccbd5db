"""The demo's outputs: per-step JSON lines, a summary table and PNG plots."""

from __future__ import annotations

import json
import pathlib
import statistics
import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from exdyna_jax.demo.trainer import MethodRun


class JsonLinesWriter:
  """Appends one JSON object per line to ``path`` (flushed per record)."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    self._file: TextIO = path.open("w")

  def write(self, record: dict[str, Any]) -> None:
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def read_json_lines(path: pathlib.Path) -> list[dict[str, Any]]:
  """The records of a JSON-lines file."""
  with path.open() as f:
    return [json.loads(line) for line in f if line.strip()]


def summarize(run: MethodRun, dense_hlo_bytes: int | None) -> dict[str, Any]:
  """One method's headline numbers (a row of the table).

  Args:
    run: the `MethodRun`.
    dense_hlo_bytes: HLO bytes per worker per step of ``dense`` on the same
      model, for the ratio (``None``: not available).

  Returns:
    A flat dict: the final metrics, ``density`` (mean achieved: indices
    transmitted / N), ``sent_over_k`` (median indices transmitted / k) and
    ``median_sent_error`` (median ``|transmitted / k - 1|``) and
    ``overflow_per_step`` (mean), all over the exchanges after the first 20
    (all of them for shorter runs: the first steps find the threshold),
    ``hlo_bytes`` (the compiled step: every
    level of a density schedule), ``stats_bytes`` (the library's count, mean
    over the steps, local ones included: what was sent), ``ratio_to_dense`` (``stats_bytes`` over
    dense's HLO bytes), ``median_step_ms``
    (without the first step) and ``final_loss`` (mean of the last 10 steps).
  """
  records = run.records
  stats_bytes = statistics.fmean(r["bytes_sent"] for r in records)
  timed = records[1:] or records
  exchanged = [r for r in records if r["sent_over_k"] is not None]  # all but local steps
  settled = exchanged[20:] or exchanged
  summary = {"method": run.method, **run.final_metrics}
  summary.update(
      final_loss=statistics.fmean(r["loss"] for r in records[-10:]),
      density=statistics.fmean(r["density"] for r in records),
      sent_over_k=statistics.median(r["sent_over_k"] for r in settled),
      median_sent_error=statistics.median(abs(r["sent_over_k"] - 1) for r in settled),
      overflow_per_step=statistics.fmean(r["overflow"] for r in settled),
      hlo_bytes=run.hlo_bytes,
      stats_bytes=stats_bytes,
      ratio_to_dense=stats_bytes / dense_hlo_bytes if dense_hlo_bytes else None,
      median_step_ms=1e3 * statistics.median(r["step_time_s"] for r in timed),
      num_elements=run.num_elements,
      target=run.target,
  )
  return summary


def format_bytes(num_bytes: float) -> str:
  """``1234567`` -> ``"1.2 MB"`` (decimal units)."""
  for unit in ("B", "kB", "MB", "GB"):
    if abs(num_bytes) < 1000 or unit == "GB":
      return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
    num_bytes /= 1000
  raise AssertionError("unreachable")


def format_table(summaries: Sequence[dict[str, Any]], metric: str, *, wide: bool = False) -> str:
  """The comparison table, one row per method, as aligned plain text.

  Args:
    summaries: `summarize` results; a ``dense`` row, if any, is the baseline
      of the metric difference.
    metric: the headline metric key, e.g. ``"test_accuracy"``.
    wide: add the median ``|sent/k - 1|`` and the compiled program's bytes
      beside the library's count (the default fits 100 columns).

  Returns:
    The table, with a legend under it.
  """
  baseline = next((s for s in summaries if s["method"] == "dense"), None)
  is_accuracy = "accuracy" in metric
  header = ["method", metric.replace("_", " ").replace("accuracy", "acc."), "vs dense",
            "density", "sent/k", "overflow", "bytes/step", "of dense's bytes", "step ms"]
  if wide:
    header[5:5] = ["med |sent/k-1|"]
    header[7:7] = ["bytes (HLO)"]
  rows = []
  for s in summaries:
    value = s[metric]
    shown = f"{100 * value:.2f} %" if is_accuracy else f"{value:.4f}"
    if baseline is None or s is baseline:
      delta = "-"
    elif is_accuracy:
      delta = f"{100 * (value - baseline[metric]):+.2f} pt"
    else:
      delta = f"{100 * (value / baseline[metric] - 1):+.2f} %"
    ratio = s["ratio_to_dense"]
    row = [s["method"], shown, delta, f"{s['density']:.4%}", f"{s['sent_over_k']:.3f}",
           f"{s['overflow_per_step']:.1f}", format_bytes(s["stats_bytes"]),
           "-" if ratio is None else f"{ratio:.3%} (1/{1 / ratio:.0f})",
           f"{s['median_step_ms']:.1f}"]
    if wide:
      row[5:5] = [f"{s['median_sent_error']:.2%}"]
      row[7:7] = [format_bytes(s["hlo_bytes"])]
    rows.append(row)
  legend = (
      "density = indices transmitted / N; sent/k = indices transmitted / k, the count asked "
      "for (median after step 20); overflow = passed the threshold but not sent (kept in the "
      "residual), per step after step 20; bytes/step = what one worker sends per step (ring "
      "collectives), the library's count, mean over the steps."
  )
  if wide:
    legend += (" bytes (HLO): counted from the compiled program (with a density schedule it "
               "holds every level; on CPU a bfloat16 wire is widened to float32).")
  return "\n".join([align(header, rows), *textwrap.wrap(legend, 100)])


def plot_runs(runs: Sequence[MethodRun], metric: str, out_dir: pathlib.Path) -> list[pathlib.Path]:
  """Writes the PNG plots of a comparison and returns their paths.

  - ``loss.png``: training loss and the held-out metric vs step, per method.
  - ``density_threshold.png``: achieved density and threshold vs step.
  - ``partitions.png``: each partition's size over the steps as a heat map,
    and its median (methods with partitions, e.g. ExDyna's rebalancing).
  - ``bytes.png``: the bytes one worker sends per step, a bar per method,
    with the compiled program's count marked and the ratio to dense.

  Args:
    runs: the `MethodRun` of each method.
    metric: the held-out metric key to plot.
    out_dir: where to write.

  Returns:
    The written paths.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  written = []

  def save(fig, name):
    path = out_dir / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

  fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(11, 4))
  for run in runs:
    steps = [r["step"] for r in run.records]
    ax_loss.plot(steps, [r["loss"] for r in run.records], label=run.method, lw=1)
    evaluated = [r for r in run.records if metric in r]
    ax_metric.plot([r["step"] for r in evaluated], [r[metric] for r in evaluated],
                   marker="o", ms=3, label=run.method)
  ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="training loss")
  ax_metric.set(xlabel="step", ylabel=metric.replace("_", " "), title=metric.replace("_", " "))
  ax_loss.legend()
  ax_metric.legend()
  save(fig, "loss.png")

  sparse = [run for run in runs if run.method != "dense"]
  fig, (ax_density, ax_threshold) = plt.subplots(1, 2, figsize=(11, 4))
  for run in sparse:
    steps = [r["step"] for r in run.records]
    (line,) = ax_density.plot(steps, [r["density"] for r in run.records],
                              label=f"{run.method} sent", lw=1.2)
    ax_density.plot(steps, [r["selected"] / run.num_elements for r in run.records], lw=0.8,
                    alpha=0.5, color=line.get_color(), label=f"{run.method} passed the threshold")
    ax_threshold.plot(steps, [r["threshold"] for r in run.records], label=run.method, lw=1)
  for run in sparse[:1]:
    target = run.target / run.num_elements
    ax_density.axhline(target, color="k", ls="--", lw=1, label="target")
    # Linear, from 0 to 3x the target: a log axis made 1 % off look like the spikes.
    ax_density.set_ylim(0, 3 * target)
  ax_density.set(xlabel="step", ylabel="fraction of N (above 3x the target: cut)",
                 title="density")
  ax_threshold.set(xlabel="step", ylabel="threshold", yscale="log", title="threshold")
  if sparse:
    ax_density.legend(fontsize=8)
    ax_threshold.legend(fontsize=8)
  save(fig, "density_threshold.png")

  partitioned = [run for run in runs if len(set(run.records[-1]["partition_starts"])) > 1]
  if partitioned:
    fig, axes = plt.subplots(len(partitioned), 2, figsize=(11, 3 * len(partitioned)),
                             squeeze=False, gridspec_kw={"width_ratios": (4, 1)})
    for (ax_map, ax_median), run in zip(axes, partitioned, strict=True):
      plot_partition_shares(fig, ax_map, ax_median, run)
    save(fig, "partitions.png")

  fig, ax = plt.subplots(figsize=(7, 0.6 * len(runs) + 1.4))
  plot_bytes(ax, runs)
  save(fig, "bytes.png")
  return written


def plot_partition_shares(fig, ax_map, ax_median, run: MethodRun) -> None:
  """Each partition's size over ``N / n`` (its equal share): a heat map by step, and the median.

  ExDyna moves every boundary each step, so lines of boundaries read as
  noise; the heat map shows which partitions stay small (dense gradients)
  and which grow, and the bars what each settles to.
  """
  from matplotlib.colors import LogNorm

  sizes = np.array([r["partition_sizes"] for r in run.records], dtype=float)
  num_partitions = sizes.shape[1]
  shares = sizes * num_partitions / sizes.sum(axis=1, keepdims=True)
  steps = [r["step"] for r in run.records]
  # Symmetric about an equal share, as wide as the data's 1st-99th percentiles need.
  extremes = np.log2(np.clip(np.percentile(shares, [1, 99]), 2.0 ** -10, None))
  spread = int(np.clip(np.ceil(np.max(np.abs(extremes))), 1, 10))
  image = ax_map.imshow(np.clip(shares, 2.0 ** -spread, 2.0 ** spread).T, aspect="auto",
                        origin="lower", cmap="RdBu_r", interpolation="nearest",
                        norm=LogNorm(2.0 ** -spread, 2.0 ** spread),
                        extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, num_partitions - 0.5))
  ax_map.set(xlabel="step", ylabel="partition (worker)",
             title=f"{run.method}: partition size / equal share (N/n)")
  ticks = [2.0 ** e for e in range(-spread, spread + 1)]
  colorbar = fig.colorbar(image, ax=ax_map, pad=0.01, ticks=ticks)
  colorbar.ax.set_yticklabels([f"{t:g}" if t >= 1 else f"1/{1 / t:g}" for t in ticks])
  colorbar.ax.minorticks_off()
  median = np.median(shares, axis=0)
  ax_median.barh(np.arange(num_partitions), median, color="0.5")
  ax_median.axvline(1.0, color="k", lw=1, ls="--")
  ax_median.set(xlim=(0, max(2.0, float(median.max()) * 1.1)), ylim=(-0.5, num_partitions - 0.5),
                yticks=[], xlabel="median share", title="over the run")


def plot_bytes(ax, runs: Sequence[MethodRun]) -> None:
  """A bar per method: mean bytes one worker sends per step, the HLO count marked, vs dense."""
  means = [float(np.mean([r["bytes_sent"] for r in run.records])) for run in runs]
  dense = next((mean for run, mean in zip(runs, means, strict=True) if run.method == "dense"),
               None)
  rows = np.arange(len(runs))[::-1]
  ax.barh(rows, means, color=[f"C{i}" for i in range(len(runs))], height=0.6)
  ax.scatter([run.hlo_bytes for run in runs], rows, marker="|", s=300, color="k",
             label="compiled program (HLO)", zorder=3)
  for row, run, mean in zip(rows, runs, means, strict=True):
    ratio = f"  1/{dense / mean:.0f} of dense" if dense and run.method != "dense" else ""
    ax.annotate(f" {format_bytes(mean)}{ratio}", (mean, row), va="center", fontsize=9)
  # Linear: a bar's length is its bytes, so 1/40 of dense looks like 1/40.
  ax.set(xlim=(0, max([*means, 1.0]) * 1.6))
  ax.set(yticks=rows, yticklabels=[run.method for run in runs], xlabel="bytes per worker per step",
         title="what one worker sends per step (the library's count, mean)")
  ax.legend(fontsize=8, loc="lower right")


def align(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """``header`` over ``rows`` as a plain-text table, columns aligned, a rule under the header."""
  cells = [[str(cell) for cell in line] for line in [header, *rows]]
  widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
           for line in cells]
  lines.insert(1, "  ".join("-" * width for width in widths))
  return "\n".join(lines)


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
  """A list of flat dicts (same keys) as an aligned plain-text table."""
  header = list(rows[0])
  return align(header, [[row[key] for key in header] for row in rows])

