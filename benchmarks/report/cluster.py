"""The REPORT section of the emulated cluster (`cluster.py`): tables, targets (figures: `plots`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.report import plots
from exdyna_jax.demo import cluster

TARGET_WORKERS, TARGET_RATE = "4", "1gbit"
ORDER = ("compute", "dense", "exdyna", "exdyna_network", "exdyna_nospill", "exdyna_reference",
         "micro", "spardl", "topk", "cltk", "hard_threshold", "exdyna_network_rounds",
         "exdyna_network_two_rounds", "exdyna_network_shell")
# Not methods: ExDyna's rounds alone, less the guard's, and in the error-feedback shell.
FLOORS = ("exdyna_network_rounds", "exdyna_network_two_rounds", "exdyna_network_shell")
LABELS = {"compute": "compute only", "exdyna_network": "exdyna network=measured",
          "exdyna_nospill": "exdyna spill=False",
          "exdyna_reference": "exdyna reference", "hierarchical_psum": "hierarchical, psum",
          "hierarchical": "hierarchical, psum_scatter",
          "exdyna_network_rounds": "floor: its rounds alone",
          "exdyna_network_two_rounds": "floor: its rounds less the guard's",
          "exdyna_network_shell": "floor: the shell and its rounds"}


def _rates(summary: dict) -> list[str]:
  rates = {rate for rows in summary.values() for by in rows.values() for rate in by
           if rate != "crossover_bps"}
  return sorted(rates, key=lambda r: float("inf") if r == "unshaped" else _bits(r))


def _bits(rate: str) -> float:
  from exdyna_jax.launch import _shaped_links

  return float(_shaped_links.parse_rate(rate) or float("inf"))


def _step_table(summary: dict, table) -> str:
  rates = _rates(summary)
  rows = []
  for workers, by_variant in summary.items():
    for variant in (v for v in ORDER if v in by_variant):
      if variant in FLOORS and workers != TARGET_WORKERS:  # the floors are the target's
        continue
      by = by_variant[variant]
      cells = [f"{by[r]['step_ms']:.0f}" if r in by else "" for r in rates]
      cross = by.get("crossover_bps")
      rows.append([workers, LABELS.get(variant, variant), *cells,
                   "" if variant in ("compute", "dense", *FLOORS) else
                   ("any rate" if cross is None else f"{cross / 1e9:.2f} Gb/s")])
  return table(["n", "method", *(f"step ms, {r}" for r in rates), "faster than dense below"],
               rows)


def _breakdown_table(rows_of: dict, rate: str, table) -> str:
  rows = []
  for variant in (v for v in ORDER if v in rows_of and rate in rows_of[v]):
    r = rows_of[variant][rate]
    measured = r["exchange_ms"] > 5 and variant != "compute"
    error = r["model_exchange_ms"] / r["exchange_ms"] - 1 if measured else None
    rows.append([
        LABELS.get(variant, variant), f"{r['step_ms']:.0f}",
        f"{r['local_ms'] - r['sparsifier_ms']:.0f}", f"{r['sparsifier_ms']:.0f}",
        f"{r['exchange_ms']:.0f}", f"{r['model_exchange_ms']:.0f}",
        "" if error is None else f"{error:+.0%}", r["rounds"],
        "" if r["bytes_sent"] is None else f"{r['bytes_sent']:,}",
    ])
  return table(["method", "step ms", "compute", "sparsifier's work", "exchange (measured)",
                "exchange (alpha-beta)", "model error", "collectives", "bytes sent / worker"],
               rows)


def _plot_steps(rep, summary: dict) -> str:
  rows_of = summary.get(TARGET_WORKERS) or next(iter(summary.values()))
  rates = _rates(summary)
  curves = {
    LABELS.get(variant, variant): [(i, rows_of[variant][r]["step_ms"])
                                   for i, r in enumerate(rates) if r in rows_of[variant]]
    for variant in ORDER if variant in rows_of
  }
  title = f"{TARGET_WORKERS} worker processes, 4.7M-parameter MLP, d = 0.001"
  return rep.save_plot(plots.step_curves(rates, curves, title), "cluster_steps.png")


def _told_network(asked, accuracy: dict) -> str:
  """What the time-to-accuracy section says of the network ExDyna was told (the demo's words)."""
  told = [f"{rate}: {cluster.told_network(asked, runs[0].get('network'))}"
          for rate, runs in accuracy.items() if asked and runs]
  return f"{'; '.join(told)} (`exdyna(network=...)`, the demo's `--network`). " if told else ""


def _hierarchical_table(runs: dict, table) -> str:
  rates = list(runs)
  steps = {rate: {r["variant"]: r["mean_ms"] for r in records if "variant" in r}
           for rate, records in runs.items()}
  rows = [[LABELS.get(v, v), *(f"{steps[r][v]:,.0f}" if v in steps[r] else "" for r in rates)]
          for v in steps[rates[0]]]
  return table(["method", *(f"step ms, {r}" for r in rates)], rows)


def _accuracy_tables(rep, accuracy: dict, table) -> list[str]:
  parts = []
  for rate, runs in accuracy.items():
    rows = cluster.summary_rows(runs)
    plot = cluster.plot_curves(runs, rep.results / f"time_to_accuracy_{rate}.png",
                               f"digits, MLP 64-2048-2048-10, 4 processes at {rate}")
    parts += [f"**{rate}**: dense's final score {cluster.dense_target(runs):.4f} (mean of its "
              "last three evaluations in its last tenth of steps); 's to dense's': seconds to "
              "it; density: indices sent / N at each evaluation; bytes per worker per step.", "",
              table(list(rows[0]), [list(row.values()) for row in rows]), "",
              f"![{plot.name}]({plot.name})", ""]
  return parts


def _run_on(cluster: dict[str, Any], part: str) -> str:
  """`` (run on DATE)`` for a part of ``cluster.json`` that records when it ran, else ''."""
  date = cluster.get("dates", {}).get(part)
  return f" (run on {date[:16].replace('T', ' ')} UTC)" if date else ""


def cluster_section(rep, cluster: dict[str, Any] | None, table) -> None:
  """Adds the emulated-cluster section and its targets to ``rep``."""
  if not cluster:
    rep.add("## Emulated cluster\n\nNo `cluster.json` (run `python -m benchmarks.cluster`).")
    return
  summary = cluster["summary"]
  rows_of = summary.get(TARGET_WORKERS, {})
  parts = [
      "## Emulated cluster: the train step over shaped links",
      "",
      f"`python -m benchmarks.cluster`{_run_on(cluster, 'steps')} (as root): worker "
      "processes, each in a network namespace of its own behind a link shaped both ways "
      "(`python -m exdyna_jax.launch --link-rate`), time the donated "
      "`data_parallel(...).step` of a 4.7M-parameter MLP (256-2048-2048-10, 32 examples "
      "per worker, d = 0.001). Step: mean wall-clock ms over the timed steps. The same step "
      "in one process on n CPU devices (collectives next to free) splits it: compute (no "
      "exchange at all), the sparsifier's own work, and the exchange (cluster minus local; "
      "negative where the processes ran the step faster than the devices of one process "
      "did). All processes share this machine's cores. 'Faster than dense below': the link "
      "rate above which dense's step, `a + b / rate` through the two slowest links, is "
      "shorter than the method's (its mean over the links).",
      "",
      _step_table(summary, table),
      "",
      _plot_steps(rep, summary),
      "",
  ]
  targets = cluster.get("targets")
  if targets:
    steps = len(next(r for r in next(iter(targets.values())) if "variant" in r)["step_ms"])
    parts += [f"**The targets' point** (`--parts targets`{_run_on(cluster, 'targets')}): "
              f"n = {TARGET_WORKERS}, each method "
              "timed in every repeat, the repeats interleaved in one launch per link (mean ms a "
              f"step over {steps} steps each); the targets below read these means.", "",
              _repeats_table(targets, table), ""]
  steps = _target_steps(targets, rows_of)
  parts += _floor_text(steps)
  if any(TARGET_RATE in by for by in rows_of.values()):  # other n: `cluster.json`
    parts += [f"**Breakdown, n = {TARGET_WORKERS}, {TARGET_RATE}** (alpha and bandwidth "
              f"fitted to this run's psum and all_gather calibration: "
              f"{_link_text(rows_of, TARGET_RATE)})", "",
              _breakdown_table(rows_of, TARGET_RATE, table), ""]
  if cluster.get("hierarchical"):
    parts += ["### Two devices per process", "",
              f"`python -m benchmarks.cluster --parts hierarchical`"
              f"{_run_on(cluster, 'hierarchical')}: 4 processes of 2 CPU "
              "devices each (8 workers; every process shares the same 2 cores). Dense and "
              "ExDyna run over all 8 devices; hierarchical runs ExDyna across the 4 processes "
              "only, `hierarchical(exdyna(0.001, axis_name=\"node\"), fast_axis=\"local\")` "
              "on a `(\"node\", \"local\")` mesh, the gradient first reduced inside each "
              "process by a `psum` or a `psum_scatter`. Mean ms a step.", "",
              _hierarchical_table(cluster["hierarchical"], table), ""]
  accuracy = cluster.get("time_to_accuracy")
  if accuracy:
    config = cluster.get("time_to_accuracy_config", {})
    told = _told_network(config.get("network"), accuracy)
    parts += ["### Time to accuracy", "",
              f"`python -m benchmarks.cluster --parts accuracy`{_run_on(cluster, 'accuracy')}: "
              f"{told}Config: `{config}`."
              if config else "", "", *_accuracy_tables(rep, accuracy, table)]
  rep.add("\n".join(parts))
  _targets(rep, steps, rows_of, accuracy)


def _repeats(targets: dict) -> dict:
  """``{variant: {rate: [mean ms of each repeat]}}`` of the targets' runs."""
  repeats: dict = {}
  for rate, records in targets.items():
    for record in (r for r in records if "variant" in r):
      repeats.setdefault(record["variant"], {}).setdefault(rate, []).append(record["mean_ms"])
  return repeats


def _target_steps(targets: dict | None, rows_of: dict) -> dict:
  """``{variant: {rate: ms}}`` the targets read: the repeats' means, else the grid's rows."""
  if not targets:
    return {variant: {rate: row["step_ms"] for rate, row in by.items() if rate != "crossover_bps"}
            for variant, by in rows_of.items()}
  return {variant: {rate: float(np.mean(ms)) for rate, ms in by.items()}
          for variant, by in _repeats(targets).items()}


def _repeats_table(targets: dict, table) -> str:
  rates = list(targets)
  rows = [[LABELS.get(variant, variant),
           *(f"{np.mean(by[r]):.1f} ({', '.join(f'{x:.1f}' for x in by[r])})" if r in by else ""
             for r in rates)]
          for variant, by in _repeats(targets).items()]
  return table(["method", *(f"step ms, {r}: mean (each repeat)" for r in rates)], rows)


def _floor_text(steps: dict) -> list[str]:
  """What ExDyna's rounds take without its work at the target point (the `FLOORS` rows)."""
  def step(variant):
    return steps.get(variant, {}).get(TARGET_RATE)

  compute, exdyna, topk, rounds, two, shell = map(
      step, ("compute", "exdyna_network", "topk", *FLOORS))
  if not all((compute, exdyna, topk, rounds, two, shell)):
    return []
  return [
      f"**Floors** (n = {TARGET_WORKERS}, {TARGET_RATE}; `cluster_worker.FLOORS`): compute "
      f"only takes {compute:.1f} ms. With the collectives of ExDyna's compiled step (told "
      f"the network), the same kinds and sizes and no other work: {rounds:.1f} ms "
      f"({rounds / compute:.2f}x compute); less the guard's round {two:.1f} ms "
      f"({two / compute:.2f}x). The library's error-feedback shell (the guard, `a = g + m`, "
      f"the dense update, the residual) around the same collectives, the values taken at "
      f"indices chosen for free: {shell:.1f} ms ({shell / compute:.2f}x), what any "
      f"error-feedback method with these rounds takes here. ExDyna: {exdyna:.1f} ms "
      f"({exdyna / compute:.2f}x; its partitions, probe count, selection and threshold "
      f"{exdyna - shell:.1f} ms over the shell). The targets ask for {1.8 * compute:.1f} ms "
      f"(1.8x compute) and {topk / 2:.1f} ms (half of Top-k's {topk:.1f}).", ""]


def _link_text(rows: dict, rate: str) -> str:
  link = next(by[rate]["link"] for by in rows.values() if rate in by)
  bandwidth = link["bandwidth_bps"]
  return (f"alpha {link['alpha_s'] * 1e3:.2f} ms, "
          f"{'unbounded' if not bandwidth else f'{bandwidth / 1e9:.2f} Gb/s'}")


def _targets(rep, steps: dict, rows_of: dict, accuracy: dict | None) -> None:
  def step(variant, rate=TARGET_RATE):
    return steps.get(variant, {}).get(rate)

  compute = step("compute")
  # ExDyna as it comes, and told the network its workers measured.
  for variant in ("exdyna", "exdyna_network"):
    exdyna = step(variant)
    if exdyna and compute:
      rep.target(f"cluster: {variant} step / compute-only (n = 4, 1 Gb/s)", "<= 1.8",
                 f"{exdyna / compute:.2f}", exdyna / compute <= 1.8)
    for other, goal in (("dense", 3.0), ("topk", 2.0)):
      if exdyna and step(other):
        ratio = step(other) / exdyna
        rep.target(f"cluster: {other} step / {variant} (n = 4, 1 Gb/s)", f">= {goal:g}",
                   f"{ratio:.2f}", ratio >= goal)
    if step(variant, "unshaped") and step("dense", "unshaped"):
      ratio = step("dense", "unshaped") / step(variant, "unshaped")
      rep.target(f"cluster: dense step / {variant} (n = 4, unshaped)", ">= 2", f"{ratio:.2f}",
                 ratio >= 2)
  errors = [abs(by[TARGET_RATE]["model_exchange_ms"] / by[TARGET_RATE]["exchange_ms"] - 1)
            for variant, by in rows_of.items()
            if TARGET_RATE in by and by[TARGET_RATE]["exchange_ms"] > 5
            and variant not in ("compute", *FLOORS)]
  if errors:
    rep.target("cluster: alpha-beta model vs measured exchange (n = 4, 1 Gb/s, > 5 ms)",
               "within 25 %", f"worst {max(errors):.0%}", max(errors) <= 0.25)
  runs = (accuracy or {}).get(TARGET_RATE)
  if runs:
    target = cluster.dense_target(runs)
    times = {run["variant"]: cluster.time_to_target(run, target) for run in runs}
    if times.get("dense") and times.get("exdyna"):
      ratio = times["dense"] / times["exdyna"]
      rep.target("cluster: time to dense's accuracy, dense / exdyna (n = 4, 1 Gb/s)", ">= 3",
                 f"{ratio:.2f}", ratio >= 3)
