"""The report's figures: each function draws one from what its section selected.

The sections (`cost`, `traffic`, `scale`, `density`, `memory`, `cluster`)
pick the numbers and write the prose and tables; this module only draws.
Every function returns the figure; `Report.save_plot` writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib
import numpy as np

from benchmarks import _common

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# A colour per registered method (dense in black), then the benchmarks' own variants.
COLORS = {
  **{name: f"C{i}" for i, name in enumerate(_common.METHODS) if name != "dense"},
  "dense": "k",
  "topk_ef": "C9",
  "dense_psum": "0.4",
  "floor": "0.7",
}

# (x, y) points of each method's curve
Curves = dict[str, list[tuple[float, float]]]


def save(fig, path) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def method_bars(names: Sequence[str], millis: Sequence[float], title: str):
  """One bar per method, ms per step on a log axis (section 1)."""
  fig, ax = plt.subplots(figsize=(8, 3.8))
  ax.barh(names, millis, color=[COLORS.get(n, "C9") for n in names])
  ax.set_xscale("log")
  ax.set_xlabel("ms per step (log)")
  ax.set_title(title)
  return fig


def ratio_panels(panels: Sequence[tuple[str, float, Curves]]):
  """ExDyna's cost ratios against the number of workers: ``(ylabel, target, curves)`` each."""
  fig, axes = plt.subplots(1, len(panels), figsize=(10, 3.6))
  for ax, (label, target, curves) in zip(axes, panels, strict=True):
    for curve, points in curves.items():
      ax.plot(*zip(*points, strict=True), marker="o" if "0.001" in curve else "s", label=curve)
    ax.axhline(target, color="r", ls="--", lw=1, label="target")
    ax.set_xlabel("workers n")
    ax.set_ylabel(label)
    ax.set_xticks([2, 4, 8])
  axes[-1].legend(fontsize=7)
  return fig


def method_curves(panels: Sequence[Sequence[tuple[str, Curves]]], ylabel: str,
                  figsize: tuple[float, float]):
  """A grid of log-log panels, each a ``(title, curves)`` of one curve per method over n."""
  fig, axes = plt.subplots(len(panels), len(panels[0]), figsize=figsize, squeeze=False)
  for ax_row, panel_row in zip(axes, panels, strict=True):
    for ax, (title, curves) in zip(ax_row, panel_row, strict=True):
      for name, points in curves.items():
        ax.plot(*zip(*points, strict=True), marker="o", ms=3, label=name, color=COLORS[name])
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_title(title)
      ax.set_xlabel("workers n")
      ax.set_ylabel(ylabel)
  axes[0][0].legend(fontsize=7)
  return fig


def training_panels(panels: Sequence[tuple[str, list[tuple[str, np.ndarray]]]], ylabel: str,
                    band: tuple[float, float] | None):
  """Per workload a ``(title, [(label, values per step)])`` panel; ``band`` shades a range."""
  columns = min(4, len(panels))
  grid = -(-len(panels) // columns)
  fig, axes = plt.subplots(grid, columns, figsize=(4.2 * columns, 3.2 * grid), squeeze=False)
  for ax, (title, runs) in zip(axes.flat, panels, strict=False):
    for label, values in runs:
      ax.plot(np.arange(1, len(values) + 1), values, lw=0.8,
              ls="-" if label == "after" else ":", label=label)
    if band:
      ax.axhspan(*band, color="g", alpha=0.15)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  axes[0][0].legend(fontsize=7)
  return fig


def memory_bars(names: Sequence[str], base_mib: np.ndarray, temp_mib: np.ndarray, title: str):
  """Stacked bars: what the update's buffers hold, and its temporaries (section 6)."""
  fig, ax = plt.subplots(figsize=(8, 3.5))
  ax.barh(names, base_mib, label="arguments + outputs - aliased")
  ax.barh(names, temp_mib, left=base_mib, label="temporaries")
  ax.set_xlabel("MiB per device")
  ax.set_title(title)
  ax.legend(fontsize=7)
  return fig


def step_curves(rates: Sequence[str], curves: dict[str, list[tuple[int, float]]], title: str):
  """The cluster's train step against the link rate, one curve per variant."""
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, points in curves.items():
    ax.plot(*zip(*points, strict=True), marker="o", label=label,
            color="k" if label == "dense" else None,
            linestyle="--" if label == "compute only" else "-")
  ax.set_xticks(range(len(rates)), rates)
  ax.set_yscale("log")
  ax.set_xlabel("link rate per worker")
  ax.set_ylabel("train step, ms (log)")
  ax.set_title(title)
  ax.legend(fontsize=7, ncol=2)
  return fig


def loss_curves(panels: Sequence[tuple[str, str, dict[str, list[tuple[float, float]]]]],
                target: float):
  """Panels ``(title, x label, {run: [(x, loss)]})``; a dotted line at ``target``.

  A run and its longer version (``name:steps``, dashed) share a colour;
  ``ddp`` is black; over ten runs, twenty colours.
  """
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
  for ax, (title, xlabel, curves) in zip(axes[0], panels, strict=True):
    bases = list(dict.fromkeys(name.partition(":")[0] for name in curves if name != "ddp"))
    palette = plt.get_cmap("tab10" if len(bases) <= 10 else "tab20").colors
    for name, points in curves.items():
      base = name.partition(":")[0]
      color = "k" if base == "ddp" else palette[bases.index(base) % len(palette)]
      ax.plot(*zip(*points, strict=True), lw=1, label=name, ls="--" if ":" in name else "-",
              color=color)
    ax.axhline(target, color="k", ls=":", lw=0.8, label="ddp's final loss")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test loss (nats per byte)")
    ax.set_xscale("log")
  axes[0][-1].legend(fontsize=6)
  return fig
