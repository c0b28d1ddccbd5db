"""Writes benchmarks/results/REPORT.md and its plots from the JSON results.

Run: python benchmarks/report.py [--results DIR]

Reads ``cost.json``, ``traffic.json``, ``collectives.json``,
``scale_model.json``, ``density_control.json`` and ``profile.json`` (any may
be missing; its section then says so) and writes ``REPORT.md`` plus
``*.png`` next to them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import _common
import matplotlib
import report_cluster

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

TARGET = {"elements": _common.RESNET18, "workers": 8, "density": 0.001}
COLORS = {
  "exdyna": "C0",
  "micro": "C1",
  "spardl": "C2",
  "topk": "C3",
  "cltk": "C4",
  "hard_threshold": "C5",
  "dense": "k",
  "topk_ef": "C6",
  "dense_psum": "0.4",
  "floor": "0.7",
}


def _load(results: pathlib.Path, name: str) -> dict[str, Any] | None:
  path = results / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def _mb(num_bytes: float) -> str:
  return f"{num_bytes / 2**20:,.2f}"


def _verdict(ok: bool) -> str:
  return "**met**" if ok else "**missed**"


def _table(header: list[str], rows: list[list[Any]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _short(n: int) -> str:
  return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


class Report:
  """Accumulates markdown sections and target verdicts."""

  def __init__(self, results: pathlib.Path):
    self.results = results
    self.parts: list[str] = []
    self.targets: list[list[str]] = []

  def add(self, text: str) -> None:
    self.parts.append(text.strip() + "\n")

  def target(self, what: str, goal: str, value: str, ok: bool | None) -> None:
    self.targets.append([what, goal, value, "n/a" if ok is None else _verdict(ok)])

  def save_plot(self, fig, name: str) -> str:
    fig.tight_layout()
    fig.savefig(self.results / name, dpi=110)
    plt.close(fig)
    return f"![{name}]({name})"


# --------------------------------------------------------------------------- 1. cost


def cost_section(rep: Report, cost: dict | None) -> None:
  rep.add("## 1. Cost: update time per step")
  if not cost:
    rep.add("_No `cost.json`._")
    return
  rep.add(
    "Median wall time of one step over interleaved repeats (warm-up excluded), "
    "all methods of a configuration measured in one run on the same gradient. "
    "`dense_psum` = `psum(g)/n`; `floor` = read gradient and residual, write "
    "residual and dense update; `topk_ef` = a Top-k error-feedback update written "
    "in the benchmark with `lax.top_k` indices only (see below why the library "
    "`topk` is slower). The devices share the machine's cores, so a step's wall "
    "time is about the sum of all devices' work; compare ratios within a row. "
    f"Grid wall time: {cost['total_seconds']:.0f} s (budget {cost['budget_seconds']:.0f} s)."
  )
  measured = cost["measured"]
  first = next((m for m in measured if all(m[k] == v for k, v in TARGET.items())), measured[0])
  med = first["median_seconds"]
  rows = []
  for name, seconds in sorted(med.items(), key=lambda kv: kv[1]):
    stats = first["stats"].get(name, {})
    rows.append(
      [
        name,
        _ms(seconds),
        f"{seconds / med['dense_psum']:.2f}",
        f"{seconds / med['floor']:.2f}",
        len(first["all_seconds"][name]),
        f"{stats['selected_over_k']:.2f}" if stats else "",
        stats.get("overflow", ""),
      ]
    )
  rep.add(
    f"### N = {_short(first['elements'])}, n = {first['workers']}, d = {first['density']}\n\n"
    + _table(
      ["method", "median ms", "x dense psum", "x floor", "timed steps", "K/k", "overflow"],
      rows,
    )
  )
  fig, ax = plt.subplots(figsize=(8, 3.8))
  names = [r[0] for r in rows]
  values = [med[n] * 1e3 for n in names]
  ax.barh(names, values, color=[COLORS.get(n, "C9") for n in names])
  ax.set_xscale("log")
  ax.set_xlabel("ms per step (log)")
  ax.set_title(
    f"Update time, N={_short(first['elements'])}, n={first['workers']}, "
    f"d={first['density']} (one run)"
  )
  rep.add(rep.save_plot(fig, "cost_target.png"))

  exdyna = med.get("exdyna")
  if exdyna:
    over_psum, over_floor = exdyna / med["dense_psum"], exdyna / med["floor"]
    rep.target("ExDyna update vs dense psum", "<= 1.2x", f"{over_psum:.2f}x", over_psum <= 1.2)
    rep.target(
      "ExDyna update vs elementwise floor", "<= 1.5x", f"{over_floor:.2f}x", over_floor <= 1.5
    )
    for name, label in (("topk", "library `topk`"), ("topk_ef", "plain `lax.top_k` EF")):
      if name in med:
        ratio = med[name] / exdyna
        rep.target(f"ExDyna faster than Top-k EF ({label})", ">= 8x", f"{ratio:.2f}x", ratio >= 8)

  rows = []
  for m in measured:
    med = m["median_seconds"]
    row = [_short(m["elements"]), m["workers"], m["density"]]
    row += [_ms(med["dense_psum"]), _ms(med["floor"])]
    for name in ("exdyna", "topk_ef", "topk", "dense"):
      row.append(_ms(med[name]) if name in med else "")
    row.append(f"{med['exdyna'] / med['dense_psum']:.2f}" if "exdyna" in med else "")
    row.append(f"{med['exdyna'] / med['floor']:.2f}" if "exdyna" in med else "")
    row.append(f"{med['topk_ef'] / med['exdyna']:.2f}" if "topk_ef" in med else "")
    rows.append(row)
  rep.add(
    "### The grid (ms per step; ratios from the same run)\n\n"
    + _table(
      [
        "N",
        "n",
        "d",
        "dense psum",
        "floor",
        "exdyna",
        "topk_ef",
        "topk",
        "dense (tx)",
        "exdyna / psum",
        "exdyna / floor",
        "topk_ef / exdyna",
      ],
      rows,
    )
  )
  if cost["skipped"]:
    skipped = ", ".join(
      f"(N={_short(c['elements'])}, n={c['workers']}, d={c['density']})" for c in cost["skipped"]
    )
    rep.add(f"Skipped to stay inside the time budget: {skipped}.")
  rep.add(
    "Not measured by design: outside the target configuration only `exdyna`, "
    "`dense` and `topk_ef` are timed (plus the library `topk` at N = 1M); the "
    "library `topk` and `cltk` at N >= 11.2M take tens of seconds per step "
    "(full sort, see section 7), so at the target configuration they get one and "
    "two timed steps after an ahead-of-time compile."
  )
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for ax, key, label in (
    (axes[0], "dense_psum", "exdyna / dense psum"),
    (axes[1], "floor", "exdyna / floor"),
  ):
    for density, marker in ((0.001, "o"), (0.01, "s")):
      for elements in sorted({m["elements"] for m in measured}):
        pts = sorted(
          (m["workers"], m["median_seconds"]["exdyna"] / m["median_seconds"][key])
          for m in measured
          if m["density"] == density
          and m["elements"] == elements
          and "exdyna" in m["median_seconds"]
        )
        if pts:
          ax.plot(*zip(*pts, strict=True), marker=marker, label=f"N={_short(elements)} d={density}")
    ax.axhline(1.2 if key == "dense_psum" else 1.5, color="r", ls="--", lw=1, label="target")
    ax.set_xlabel("workers n")
    ax.set_ylabel(label)
    ax.set_xticks([2, 4, 8])
  axes[1].legend(fontsize=7)
  rep.add(rep.save_plot(fig, "cost_grid.png"))


# ------------------------------------------------------------------------ 2. traffic


def traffic_section(rep: Report, traffic: dict | None) -> None:
  rep.add("## 2. Traffic: bytes per worker per step, from the compiled HLO")
  if not traffic:
    rep.add("_No `traffic.json`._")
    return
  size = traffic["elements"]
  rep.add(
    f"N = {size:,} (ResNet-18). Every method's real `shard_map` step was compiled for "
    "n forced CPU devices (nothing runs, so n goes to 1024) and every collective of "
    "the compiled HLO was read with its shapes. Conversion to bytes **sent per "
    "worker** (received is the same: every op is symmetric), ring algorithms, "
    "`g` workers in the op, `M` = bytes of the op's result:\n\n"
    "- all-reduce of `M`: `2 (g-1)/g * M` (reduce-scatter + all-gather);\n"
    "- all-gather with result `M` (= g blocks): `(g-1)/g * M`;\n"
    "- reduce-scatter with result `R` per worker: `(g-1) * R`;\n"
    "- all-to-all of `M`: `(g-1)/g * M`;\n"
    "- collective-permute of `M`: `M` (every worker sends one message).\n\n"
    "Collectives inside a `conditional` count once, for the largest branch. "
    "Dense reference: ring all-reduce of N float32, `2 (n-1)/n * 4N`. "
    "`stats` = the method's own `stats.bytes_sent`, read by running the step."
  )
  rows_by = {(r["method"], r["density"], r["workers"]): r for r in traffic["rows"]}
  small = [n for n in traffic["workers"] if n <= 16]
  for density in traffic["densities"]:
    rows = []
    for name in _common.METHODS:
      row = [name]
      for n in small:
        r = rows_by.get((name, density, n))
        row.append(f"{r['bytes']:,.0f}" if r else "")
      r8 = rows_by.get((name, density, 8))
      row.append(f"{r8['dense_ring_bytes'] / r8['bytes']:,.0f}x" if r8 else "")
      lo, hi = rows_by.get((name, density, small[0])), rows_by.get((name, density, small[-1]))
      row.append(f"{hi['bytes'] / lo['bytes']:.2f}" if lo and hi else "")
      checks = [
        abs(rows_by[(name, density, n)]["bytes"] - rows_by[(name, density, n)]["stats_bytes_sent"])
        / rows_by[(name, density, n)]["bytes"]
        for n in traffic["checked_workers"]
        if (name, density, n) in rows_by and "stats_bytes_sent" in rows_by[(name, density, n)]
      ]
      row.append(f"{100 * max(checks):.3f} %" if checks else "")
      rows.append(row)
    rep.add(
      f"### d = {density}: bytes sent per worker per step\n\n"
      + _table(
        [
          "method",
          *[f"n={n}" for n in small],
          "dense / method at n=8",
          f"n={small[-1]} / n={small[0]}",
          "max |HLO - stats| / HLO",
        ],
        rows,
      )
    )
  for density, target in ((0.001, 400), (0.01, 40)):
    r8 = rows_by.get(("exdyna", density, 8))
    if r8:
      ratio = r8["dense_ring_bytes"] / r8["bytes"]
      rep.target(
        f"ExDyna traffic below dense, d={density}, n=8",
        f">= {target}x",
        f"{ratio:,.0f}x",
        ratio >= target,
      )
  for density in traffic["densities"]:
    lo, hi = rows_by.get(("exdyna", density, 2)), rows_by.get(("exdyna", density, 16))
    if lo and hi:
      raw = hi["bytes"] / lo["bytes"]
      rel = (hi["bytes"] / hi["dense_ring_bytes"]) / (lo["bytes"] / lo["dense_ring_bytes"])
      rep.target(
        f"ExDyna traffic does not grow n=2..16, d={density}",
        "at most +10 %",
        f"raw bytes x{raw:.2f}; per ring factor (n-1)/n x{rel:.3f}",
        rel <= 1.10,
      )
  ops8 = [
    r for r in traffic["rows"] if r["workers"] == 8 and r["density"] == traffic["densities"][0]
  ]
  rows = []
  for r in ops8:
    for op in r["ops"]:
      rows.append(
        [
          r["method"],
          op["kind"],
          ", ".join(op["shapes"]),
          op["context"] or "",
          f"{op['bytes']:,.0f}",
          f"{op['messages']:.0f}",
        ]
      )
  rep.add(
    f"### The collectives of one step, n = 8, d = {traffic['densities'][0]}\n\n"
    + _table(["method", "op", "result shape", "inside", "bytes sent", "ring messages"], rows)
  )
  fig, axes = plt.subplots(1, len(traffic["densities"]), figsize=(11, 4), squeeze=False)
  for ax, density in zip(axes[0], traffic["densities"], strict=True):
    for name in _common.METHODS:
      pts = sorted(
        (r["workers"], r["bytes"])
        for r in traffic["rows"]
        if r["method"] == name and r["density"] == density
      )
      if pts:
        ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=name, color=COLORS[name])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers n")
    ax.set_ylabel("bytes sent per worker per step")
    ax.set_title(f"d = {density}, N = {_short(size)} (from compiled HLO)")
  axes[0][0].legend(fontsize=7)
  rep.add(rep.save_plot(fig, "traffic.png"))


def two_level_section(rep: Report, scale: dict | None) -> None:
  """Section 3's two-level variant: hosts of L devices, `exdyna_jax.hierarchical`."""
  two = (scale or {}).get("two_level")
  if not two:
    return
  preds = two["predictions"]
  intra = two["intra_links"]
  rep.add(
    "### Two levels: H hosts of L devices (`exdyna_jax.hierarchical`)\n\n"
    "Per step: the dense phase inside each host (`psum` mode: an all-reduce of the "
    "4N-byte gradient; `scatter` mode: reduce-scatter + all-gather, the same bytes), "
    "then the method's compiled collectives for `n = H` workers, run by each host's L "
    "devices at once over one host link of B (the link carries L times one device's "
    "bytes). In `scatter` mode each device exchanges an N/L slice: payload bytes / L. "
    "`dense` in `scatter` mode is the hierarchical all-reduce. Intra-host links: "
    + ", ".join(
      f"{name} {v['bytes_per_second'] / 1e9:.0f} GB/s, {v['alpha_seconds'] * 1e6:.0f} us"
      for name, v in intra.items()
    )
    + "; alpha between hosts as above. Assumptions in `benchmarks/scale_model.py`."
  )
  methods = [m for m in _common.METHODS if any(p["method"] == m for p in preds)]
  density = min({p["density"] for p in preds})
  for local, link_name in ((4, "nvlink"), (8, "nvlink"), (8, "pcie")):
    sel = [
      p
      for p in preds
      if p["local"] == local and p["intra"] == link_name and p["density"] == density
    ]
    ns = sorted({p["workers"] for p in sel})
    rows = []
    for name in methods:
      for mode in ("psum", "scatter"):
        by_n = {p["workers"]: p for p in sel if p["method"] == name and p["mode"] == mode}
        if by_n:
          cells = [_ms(by_n[n]["seconds"]["25"]) if n in by_n else "" for n in ns]
          rows.append([name, mode, *cells])
    if rows:
      rep.add(
        f"#### Predicted ms per step, L = {local}, {link_name} inside hosts, 25 Gb/s "
        f"between hosts, d = {density} (other links and densities: `scale_model.json`)\n\n"
        + _table(["method", "mode", *[f"n={n} (H={n // local})" for n in ns]], rows)
      )


# -------------------------------------------------------------------- 3. scale model


def scale_section(rep: Report, scale: dict | None, collectives: dict | None) -> None:
  rep.add("## 3. Scale model: communication time per step, n = 8 to 1024")
  if not scale:
    rep.add("_No `scale_model.json`._")
    return
  alpha = scale["alpha_seconds"]
  rep.add(
    "`T = sum over the step's collectives of (messages * alpha + bytes * 8 / B)`, "
    "bytes and messages per worker from the compiled HLO of each n (section 2, "
    "compiled for real up to n = 1024). Each op takes the faster of the ring "
    "(`2(g-1)` messages per all-reduce, `g-1` per all-gather, 1 per permute) and the "
    "latency-optimal algorithm with the same bytes (Rabenseifner / recursive doubling "
    "/ Bruck: `2 log2 g` and `log2 g` messages), as MPI and NCCL choose by size.\n\n"
    "Assumptions: one worker per host; a non-blocking network where the host link "
    f"of B bit/s is the bottleneck, full duplex; alpha = {alpha * 1e6:.0f} us per "
    "message; the step's collectives run one after another and do not overlap "
    "compute; int32 indices and float32 values as compiled. Compute time is not "
    "included (the CPU numbers of section 1 do not transfer to accelerators). "
    "ExDyna beyond n = 256 uses `num_blocks = 4n` (the reference supports "
    "n <= 256 with 1024 blocks). The ring-only prediction is in `scale_model.json` "
    "as `seconds_ring` (at n = 1024 it is latency-bound: thousands of messages per "
    "all-reduce)."
  )
  preds = scale["predictions"]
  densities = sorted({p["density"] for p in preds})
  ns = sorted({p["workers"] for p in preds})
  for density in densities:
    for link in ("25", "100"):
      rows = []
      for name in _common.METHODS:
        by_n = {p["workers"]: p for p in preds if p["method"] == name and p["density"] == density}
        rows.append([name] + [_ms(by_n[n]["seconds"][link]) if n in by_n else "" for n in ns])
      rep.add(
        f"### Predicted ms per step, d = {density}, {link} Gb/s\n\n"
        + _table(["method", *[f"n={n}" for n in ns]], rows)
      )
  fig, axes = plt.subplots(len(densities), 4, figsize=(15, 3.6 * len(densities)), squeeze=False)
  for i, density in enumerate(densities):
    for j, link in enumerate(str(x) for x in scale["links_gbps"]):
      ax = axes[i][j]
      for name in _common.METHODS:
        pts = sorted(
          (p["workers"], p["seconds"][link] * 1e3)
          for p in preds
          if p["method"] == name and p["density"] == density
        )
        if pts:
          ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=name, color=COLORS[name])
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_title(f"{link} Gb/s, d = {density}")
      ax.set_xlabel("workers n")
      ax.set_ylabel("ms per step (model)")
  axes[0][0].legend(fontsize=7)
  rep.add(rep.save_plot(fig, "scale_model.png"))
  if not collectives:
    rep.add("_No `collectives.json`: the model was not checked on this machine._")
    return
  fits = collectives["fits"]
  rep.add(
    "### Check against measured CPU collectives\n\n"
    f"On n = {collectives['workers']} CPU devices, `psum`, `all_gather` and `ppermute` "
    "with results of 4 KB to 64 MB were timed and `t = alpha + ring_bytes / beta` fitted per "
    "op kind. The shared-memory 'network' of one host has nothing to do with a real "
    "link, so the constants are only this machine's; what is checked is the model's "
    "structure (a fixed cost per op plus a cost linear in the ring bytes, additive "
    "over the ops of a step): each method's collectives, as counted in its compiled "
    "step, were replayed in one program with the same kinds and shapes and timed.\n\n"
    + _table(
      ["op", "alpha (us)", "beta (GB/s)", "median fit error"],
      [
        [
          k,
          f"{v['alpha_seconds'] * 1e6:.0f}",
          f"{v['beta_bytes_per_second'] / 1e9:.2f}",
          f"{100 * v['median_abs_relative_error']:.0f} %",
        ]
        for k, v in fits.items()
      ],
    )
  )
  rows = [
    [
      c["method"],
      c["density"],
      c["ops"],
      f"{c['ring_bytes']:,.0f}",
      f"{c['measured_seconds'] * 1e3:.2f}",
      f"{c['predicted_seconds'] * 1e3:.2f}",
      f"{c['measured_over_predicted']:.2f}",
    ]
    for c in collectives["replays"]
  ]
  if rows:
    errors = [abs(c["measured_over_predicted"] - 1) for c in collectives["replays"]]
    rep.add(
      _table(
        ["method", "d", "ops", "ring bytes", "measured ms", "model ms", "measured / model"], rows
      )
      + f"\n\nMedian |measured / model - 1| over the replays: {100 * np.median(errors):.0f} %."
    )


# ------------------------------------------------------------ 4-5. density, balance


WORKLOAD_NAMES = {
  "digits_mlp": "digits MLP (the demo's)",
  "mlp_1m": "MLP, hidden 1024",
  "char_transformer": "char transformer",
  "cnn_1d": "1-D CNN",
  "positional": "positional profile",
  "heterogeneous": "heterogeneous workers",
}


def _panels(runs: list[dict]) -> list[tuple[str, float]]:
  seen = []
  for r in runs:
    if (r["workload"], r["density"]) not in seen:
      seen.append((r["workload"], r["density"]))
  return seen


def density_sections(rep: Report, density: dict | None) -> None:
  rep.add("## 4. Density sent: indices transmitted / k")
  if not density or not all("label" in r for r in density["runs"]):
    rep.add("_No `density_control.json` in this format._")
    rep.add("## 5. Balance")
    return
  runs = density["runs"]
  targets_workers = next(
    (r.get("workers", density["workers"]) for r in runs if r["label"] == "after"),
    density["workers"],
  )
  rep.add(
    f"`benchmarks/density_control.py`: n = {targets_workers} workers simulated with "
    f"`jax.vmap(axis_name=)`, {density['steps']} steps, default `exdyna(d)`. What the user "
    "gets: sent/k = indices transmitted over k = floor(d N) (1 is what was asked for); "
    "overflow = elements that passed the threshold but were not sent (they stay in "
    "the residual); imbalance = max / mean of the partitions' pass counts; bytes = what one "
    "worker sends per step (`stats.bytes_sent`). All over steps 21..end. 'before' is the "
    "library before the balanced partitioner (neighbour rule, `capacity_factor=1.5`, "
    "controller steering what passed the threshold), run by the same script; "
    "'after-n4' and 'after-n16' are the current library on 4 and 16 workers (column n), "
    "a check beyond the 8 the targets are set for."
  )
  rows = []
  for r in runs:
    s = r["summary"]
    metric = next(iter(r.get("metrics") or {}), None)
    shown = "" if metric is None else f"{metric.replace('_', ' ')} {r['metrics'][metric]:.4g}"
    rows.append(
      [
        WORKLOAD_NAMES.get(r["workload"], r["workload"]),
        f"{r['elements']:,}",
        r["density"],
        r["target"],
        r.get("workers", density["workers"]),
        r["label"],
        f"{s['median_sent_over_k']:.3f}",
        f"{100 * s['median_abs_sent_error']:.1f} %",
        f"{100 * s['p90_abs_sent_error']:.1f} %",
        f"{100 * s['mean_overflow_over_k']:.2f} %",
        f"{s['median_imbalance']:.2f}",
        f"{s['bytes_sent']:,}",
        shown,
      ]
    )
    if r["label"] == "after":
      bound = 0.05 if r["workload"] == "heterogeneous" else 0.03
      name = f"{r['workload']} d={r['density']}"
      rep.target(f"{name}: median error of sent/k", f"<= {bound:.0%}",
                 f"{100 * s['median_abs_sent_error']:.1f} %", s["median_abs_sent_error"] <= bound)
      if r["workload"] != "heterogeneous":
        rep.target(f"{name}: overflow / k", "<= 1 %", f"{100 * s['mean_overflow_over_k']:.2f} %",
                   s["mean_overflow_over_k"] <= 0.01)
  rep.add(
    _table(
      ["workload", "N", "d", "k", "n", "library", "sent/k", "median err", "p90 err",
       "overflow / k", "imbalance", "bytes/step", "after training"],
      rows,
    )
  )
  panels = _panels(runs)
  columns = min(4, len(panels))
  grid = -(-len(panels) // columns)
  for field, name, ylabel in (
    ("transmitted", "density_control.png", "sent / k"),
    ("imbalance", "balance.png", "imbalance (max / mean)"),
  ):
    fig, axes = plt.subplots(grid, columns, figsize=(4.2 * columns, 3.2 * grid), squeeze=False)
    for ax, (workload, d) in zip(axes.flat, panels, strict=False):
      for r in runs:
        if (r["workload"], r["density"]) == (workload, d):
          values = np.asarray(r[field], float)
          if field == "transmitted":
            values = values / r["target"]
          ax.plot(np.arange(1, len(values) + 1), values, lw=0.8,
                  ls="-" if r["label"] == "after" else ":", label=r["label"])
      if field == "transmitted":
        ax.axhspan(0.97, 1.03, color="g", alpha=0.15)
      ax.set_title(f"{WORKLOAD_NAMES.get(workload, workload)}, d = {d}", fontsize=9)
      ax.set_xlabel("step")
      ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(panels):]:
      ax.axis("off")
    axes[0][0].legend(fontsize=7)
    rep.add(rep.save_plot(fig, name))
  rep.add("## 5. Balance")
  rep.add(
    "The imbalance plot above: the balanced partitioner re-cuts every partition each step "
    "from the measured block workload, so what remains is the count's swing from step to "
    "step (about +-35 % per partition on the trained models, where whole layers' shares of "
    "the selection change with the batch); the default capacity `C = (2.3 + 4 / sqrt(k/n)) "
    "k/n` absorbs it, and only about 1.1 k values are summed whatever `C`."
  )


def training_options_section(rep: Report, options: dict | None) -> None:
  if not options:
    rep.add("## Density warm-up and bfloat16 values\n\nNot run (`training_options.py`).")
    return
  rows = []
  dense = {}
  for row in options["rows"]:
    key = (row["model"], row["density"])
    if row["variant"] == "dense":
      dense[key] = row
    base = dense.get(key)
    shown = f"{100 * row['value']:.2f} %" if "accuracy" in row["metric"] else f"{row['value']:.3f}"
    if base is None or row is base:
      delta = "-"
    elif "accuracy" in row["metric"]:
      delta = f"{100 * (row['value'] - base['value']):+.2f} pt"
    else:
      delta = f"{100 * (row['value'] / base['value'] - 1):+.2f} %"
    ratio = "-" if base is None else f"{row['mean_bytes_sent'] / base['mean_bytes_sent']:.3f}"
    rows.append([
        row["model"], row["density"], row["variant"], row["metric"].replace("_", " "), shown,
        delta, f"{row['mean_density_sent']:.3%}", f"{row['mean_bytes_sent'] / 1e3:,.1f} kB", ratio,
    ])
  wire = options["wire"]
  f32, bf16 = wire["bytes"]["float32"], wire["bytes"]["bfloat16"]
  rep.target("bytes per step, bf16 values / float32", "<= 0.8", f"{bf16 / f32:.3f}",
             bf16 <= 0.8 * f32)
  rep.add(
      "## Density warm-up and bfloat16 values\n\n"
      "`python benchmarks/training_options.py`: each model trained on 8 simulated workers "
      f"for {options['rows'][0]['steps']} steps with the same batches per variant "
      "(the demo's trainer). *warm-up*: `density=exdyna_jax.dgc_warmup(d, "
      "steps_per_level=25)` (25 %, 6.25 %, 1.56 %, ... then `d`, 25 steps each); "
      "*bf16 values*: `value_dtype=\"bfloat16\"`. Bytes: mean per worker per step, "
      "the library's count (it follows the warm-up's levels); ratio to dense.\n\n"
      + _table(["model", "d", "variant", "metric", "value", "vs dense", "density sent",
                "bytes/step", "bytes vs dense"], rows)
      + f"\n\nOne ExDyna step at N = {_short(wire['num_elements'])}, n = 8, d = 0.001 "
      f"sends {f32:,} bytes per worker with float32 values and {bf16:,} with bfloat16 "
      f"({bf16 / f32:.3f}): the index all-gather is unchanged, the value all-reduce "
      "halves. (XLA's CPU backend widens a bfloat16 all-reduce to float32 before "
      "reducing; GPU collectives keep it.)"
  )


# ----------------------------------------------------------------------- 6. memory


def memory_section(rep: Report, traffic: dict | None) -> None:
  rep.add("## 6. Memory per device of the update (`compiled.memory_analysis()`)")
  rows8 = [r for r in (traffic or {}).get("rows", []) if r["workers"] == 8 and "memory" in r]
  if not rows8:
    rep.add("_No memory analysis in `traffic.json`._")
    return
  size = traffic["elements"]
  rep.add(
    f"n = 8, N = {size:,} (one float32 vector = {_mb(4 * size)} MiB), state donated as in "
    "training. Arguments = gradient + optimizer state; outputs = update + new state; "
    "aliased = output buffers that reuse the donated state; "
    "peak estimate = arguments + outputs - aliased + temporaries."
  )
  for density in traffic["densities"]:
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
          _mb(m["argument"]),
          _mb(m["output"]),
          _mb(m["alias"]),
          _mb(m["temp"]),
          _mb(peak),
          f"{peak / (4 * size):.1f}",
          f"{peak / dense_peak:.2f}" if dense_peak else "",
        ]
      )
    rep.add(
      f"### d = {density} (MiB)\n\n"
      + _table(
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
  fig, ax = plt.subplots(figsize=(8, 3.5))
  sel = [r for r in rows8 if r["density"] == density]
  names = [r["method"] for r in sel]
  base = (
    np.array(
      [(r["memory"]["argument"] + r["memory"]["output"] - r["memory"]["alias"]) for r in sel]
    )
    / 2**20
  )
  temp = np.array([r["memory"]["temp"] for r in sel]) / 2**20
  ax.barh(names, base, label="arguments + outputs - aliased")
  ax.barh(names, temp, left=base, label="temporaries")
  ax.set_xlabel("MiB per device")
  ax.set_title(f"Memory of the update, n = 8, d = {density}, N = {_short(size)}")
  ax.legend(fontsize=7)
  rep.add(rep.save_plot(fig, "memory.png"))


# ---------------------------------------------------------------------- 7. profile


def profile_section(rep: Report, profile: dict | None, cost: dict | None) -> None:
  rep.add("## 7. Profile: what stands between ExDyna and the floor")
  if not profile:
    rep.add("_No `profile.json`._")
    return
  static = profile["static"]
  rows = [[name, f"{v['vectors']:.1f}"] for name, v in static.items()]
  rep.add(
    f"N = {_short(profile['elements'])}, n = {profile['workers']}, d = {profile['density']}. "
    "Static profile of the compiled per-device programs (the HLO `--xla_dump_to` would "
    "write, read from `compiled.as_text()`): bytes read + written by every top-level op "
    "(after fusion) that touches an array of at least N/(2n) float32, in units of one "
    "N-vector of float32 (4N bytes). The floor needs 4 (read gradient and residual, "
    "write residual and update); on this memory-bound CPU the step time follows this "
    "count. Scatters count as in place, gathers and slices (also inside a fusion) as "
    "reading what they return; a `conditional` counts as the branch a normal step takes "
    "(the cheapest of its branches that communicate); a `while` counts one trip, so the "
    "adaptive controller's probe count, a loop over chunks of N/(8n) that reads the "
    "worker's partition (about 1/n of a vector), is below the size cut and not listed. "
    "`patch=no_guard`: the non-finite guard's two functions "
    "(`_feedback.count_nonfinite`, `skip_if_nonfinite`) swapped out while tracing, "
    "library files untouched; `patch=kth_min`: `_selection.select_top_k` reads the k-th "
    "magnitude as a minimum.\n\n" + _table(["program", "N-vectors moved per step"], rows)
  )
  ex = static.get("exdyna")
  if ex:
    rows = [[f"{o['vectors']:.2f}", o["opcode"], f"`{o['op_name'][-70:]}`"] for o in ex["ops"]]
    rep.add(
      "Largest passes of the ExDyna step:\n\n" + _table(["N-vectors", "op", "from (op_name)"], rows)
    )
  timing = profile["timing"]["median_seconds"]
  rows = [
    [name, _ms(s), f"{s / timing['dense_psum']:.2f}", f"{s / timing['floor']:.2f}"]
    for name, s in sorted(timing.items(), key=lambda kv: kv[1])
  ]
  rep.add(
    "Timing variants (one interleaved run):\n\n"
    + _table(["variant", "median ms", "x dense psum", "x floor"], rows)
  )


# ------------------------------------------------------------------------- header


def header(rep: Report, sources: dict[str, dict | None]) -> str:
  machine = next((s["machine"] for s in sources.values() if s), {})
  lines = [
    "# exdyna_jax benchmarks",
    "",
    "Generated by `python benchmarks/run.py` (all sections; `--quick` for a smoke "
    "run, `--only cost,report` to redo one part) from the JSON files in this "
    "directory. Do not edit by hand.",
    "",
    "## Machine and versions",
    "",
  ]
  rows = []
  for name, src in sources.items():
    if not src:
      continue
    m = src["machine"]
    rows.append(
      [
        name,
        m["date_utc"],
        ", ".join(f"{x:.1f}" for x in m["load_average"]),
        m["git_commit"] + (" + local changes" if m["library_modified_since_commit"] else ""),
      ]
    )
  lines += [
    f"- CPU: {machine.get('cpu')} ({machine.get('cores')} cores), "
    f"{machine.get('memory_gb')} GB RAM; {machine.get('platform')}",
    f"- Python {machine.get('python')}, jax {machine.get('jax')}, jaxlib "
    f"{machine.get('jaxlib')}, optax {machine.get('optax')}, numpy {machine.get('numpy')}, "
    f"exdyna_jax {machine.get('exdyna_jax')}",
    "- Forced CPU devices share the cores: 8 devices on "
    f"{machine.get('cores')} cores. Other processes were running (load averages "
    "below), so absolute times are noisy; methods are compared as ratios measured "
    "in the same run, interleaved.",
    "",
    _table(["result", "measured (UTC)", "load average 1/5/15 min", "library commit"], rows),
    "",
  ]
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--results", default=str(_common.RESULTS))
  args = parser.parse_args()
  results = pathlib.Path(args.results)
  names = (
      "cost", "traffic", "collectives", "scale_model", "density_control", "training_options",
      "profile", "cluster",
  )
  sources = {name: _load(results, name) for name in names}
  rep = Report(results)
  cost_section(rep, sources["cost"])
  traffic_section(rep, sources["traffic"])
  scale_section(rep, sources["scale_model"], sources["collectives"])
  two_level_section(rep, sources["scale_model"])
  density_sections(rep, sources["density_control"])
  training_options_section(rep, sources["training_options"])
  memory_section(rep, sources["traffic"])
  profile_section(rep, sources["profile"], sources["cost"])
  report_cluster.cluster_section(rep, sources["cluster"], _table)
  targets = (
    "## Targets (N = 11.2M, n = 8, d = 0.001 unless stated)\n\n"
    + _table(["target", "goal", "measured", "verdict"], rep.targets)
    + "\n"
  )
  extra = results / "NOTES.md"
  notes = extra.read_text() if extra.exists() else ""
  text = "\n".join([header(rep, sources), targets, notes, *rep.parts])
  (results / "REPORT.md").write_text(text)
  _common.log(f"wrote {results / 'REPORT.md'}")


if __name__ == "__main__":
  sys.exit(main())
