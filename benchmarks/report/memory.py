"""Section 6: the bytes one step reads and writes."""

from __future__ import annotations

import numpy as np

from benchmarks.report import plots
from benchmarks.report._format import Report, mb, short, table

# ----------------------------------------------------------------------- 6. memory


def memory_section(rep: Report, traffic: dict | None) -> None:
  rep.add("## 6. Memory per device of the update (`compiled.memory_analysis()`)")
  rows8 = [r for r in (traffic or {}).get("rows", []) if r["workers"] == 8 and "memory" in r]
  if not rows8:
    rep.add("_No memory analysis in `traffic.json`._")
    return
  size = traffic["elements"]
  rep.add(
    f"n = 8, N = {size:,} (one float32 vector = {mb(4 * size)} MiB), state donated as in "
    "training. Arguments = gradient + optimizer state; outputs = update + new state; "
    "aliased = output buffers that reuse the donated state; "
    "peak estimate = arguments + outputs - aliased + temporaries."
  )
  for density in traffic["densities"][:1]:  # the others: the plot and `traffic.json`
    rows = []
    dense = next((r for r in rows8 if r["method"] == "dense" and r["density"] == density), None)
    dense_peak = None
    if dense:
      m = dense["memory"]
      dense_peak = m["argument"] + m["output"] - m["alias"] + m["temp"]
    for r in rows8:
      if r["density"] != density:
        continue
      m = r["memory"]
      peak = m["argument"] + m["output"] - m["alias"] + m["temp"]
      rows.append(
        [
          r["method"],
          mb(m["argument"]),
          mb(m["output"]),
          mb(m["alias"]),
          mb(m["temp"]),
          mb(peak),
          f"{peak / (4 * size):.1f}",
          f"{peak / dense_peak:.2f}" if dense_peak else "",
        ]
      )
    rep.add(
      f"### d = {density} (MiB)\n\n"
      + table(
        [
          "method",
          "arguments",
          "outputs",
          "aliased",
          "temporaries",
          "peak estimate",
          "peak / 4N",
          "peak / dense",
        ],
        rows,
      )
    )
  density = traffic["densities"][0]
  sel = [r for r in rows8 if r["density"] == density]
  base = np.array([r["memory"]["argument"] + r["memory"]["output"] - r["memory"]["alias"]
                   for r in sel]) / 2**20
  temp = np.array([r["memory"]["temp"] for r in sel]) / 2**20
  fig = plots.memory_bars([r["method"] for r in sel], base, temp,
                          f"Memory of the update, n = 8, d = {density}, N = {short(size)}")
  rep.add(rep.save_plot(fig, "memory.png"))


def optimizer_state_section(rep: Report, runs: dict | None) -> None:
  """Step time, temporaries and weight copies with an optimizer state after the sparsifier."""
  rep.add("## 6b. The optimizer after the sparsifier (`optimizer_state.py`)")
  if not runs:
    rep.add("_Not run (`python -m benchmarks.optimizer_state`)._")
    return
  config = runs["config"]
  rows = [[row["method"], row["inner"], f"{row['step_ms']:.1f}", f"{row['temp_mib']:.1f}",
           row["big_copies"]] for row in runs["rows"]]
  rep.add(
      f"The donated `data_parallel(...).step` on {config['devices']} CPU devices, an MLP "
      f"{'-'.join(map(str, config['sizes']))}, {config['batch']} examples per worker, "
      f"d = {config['density']} for ExDyna: the median step, the compiled step's "
      "temporaries and its `copy` ops of weight-sized arrays.\n\n"
      + table(["method", "after it", "step ms", "temporaries MiB", "weight-sized copies"], rows)
  )
