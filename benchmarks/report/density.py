"""Sections 4-5: the density sent, balance and overflow over training; training options."""

from __future__ import annotations

import numpy as np

from benchmarks.report import plots
from benchmarks.report._format import Report, short, table

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


def _worst(runs: list[dict], field: str) -> tuple[float, str]:
  """The largest ``summary[field]`` among ``runs``, and which workload and density had it."""
  run = max(runs, key=lambda r: r["summary"][field])
  name = WORKLOAD_NAMES.get(run["workload"], run["workload"])
  return run["summary"][field], f"{name}, d = {run['density']}"


def _density_targets(rep: Report, after: list[dict]) -> None:
  """The targets at the targets' worker count: the worst workload of each."""
  trained = [r for r in after if r["workload"] != "heterogeneous"]
  for runs, bound in ((trained, 0.03), ([r for r in after if r not in trained], 0.05)):
    if runs:
      worst, where = _worst(runs, "median_abs_sent_error")
      rep.target(f"median error of sent/k: {where} (worst of {len(runs)})",
                 f"<= {bound:.0%}", f"{100 * worst:.1f} %", worst <= bound)
  if trained:
    worst, where = _worst(trained, "mean_overflow_over_k")
    rep.target(f"overflow / k: {where} (worst of {len(trained)})", "<= 1 %",
               f"{100 * worst:.2f} %", worst <= 0.01)


def _density_row(run: dict, runs: list[dict]) -> list:
  """One workload at one density: n = 8's figures, and sent/k on every worker count."""
  s = run["summary"]
  metric = next(iter(run.get("metrics") or {}), None)
  shown = "" if metric is None else f"{metric.replace('_', ' ')} {run['metrics'][metric]:.4g}"
  same = [r for r in runs if (r["workload"], r["density"]) == (run["workload"], run["density"])]
  sent = [next((f"{r['summary']['median_sent_over_k']:.3f}" for r in same if r["label"] == label),
               "-") for label in ("after-n4", "after", "after-n16")]
  return [WORKLOAD_NAMES.get(run["workload"], run["workload"]), f"{run['elements']:,}",
          run["density"], run["target"], " / ".join(sent),
          f"{100 * s['median_abs_sent_error']:.1f} %", f"{100 * s['p90_abs_sent_error']:.1f} %",
          f"{100 * s['mean_overflow_over_k']:.2f} %", f"{s['median_imbalance']:.2f}",
          f"{s['bytes_sent']:,}", shown]


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
  sent = sorted(r["summary"]["median_sent_over_k"] for r in runs if r["label"] == "before")
  before = f"{sent[0]:.2f}-{sent[-1]:.2f}" if sent else "not measured"
  rep.add(
    f"`benchmarks/density_control.py`: n = {targets_workers} workers simulated with "
    f"`jax.vmap(axis_name=)`, {density['steps']} steps, default `exdyna(d)`. What the user "
    "gets: sent/k = indices transmitted over k = floor(d N) (1 is what was asked for); "
    "overflow = elements that passed the threshold but were not sent (they stay in "
    "the residual); imbalance = max / mean of the partitions' pass counts; bytes = what one "
    "worker sends per step (`stats.bytes_sent`). All over steps 21..end. 'before' (in the "
    "plots) is the library before the balanced partitioner (neighbour rule, "
    "`capacity_factor=1.5`, controller steering what passed the threshold), run by the "
    f"same script: its sent/k was {before}. The table gives n = {targets_workers}, and the "
    "sent/k of the current library on 4 and 16 workers beside it, a check beyond the "
    f"{targets_workers} the targets are set for."
  )
  _density_targets(rep, [r for r in runs if r["label"] == "after"])
  rep.add(table(
      ["workload", "N", "d", "k", "sent/k, n = 4 / 8 / 16", "median err", "p90 err",
       "overflow / k", "imbalance", "bytes/step", "after training"],
      [_density_row(r, runs) for r in runs if r["label"] == "after"]))
  for field, name, ylabel in (
    ("transmitted", "density_control.png", "sent / k"),
    ("imbalance", "balance.png", "imbalance (max / mean)"),
  ):
    panels = [
      (f"{WORKLOAD_NAMES.get(workload, workload)}, d = {d}",
       [(r["label"], np.asarray(r[field], float) / (r["target"] if field == "transmitted" else 1))
        for r in runs if (r["workload"], r["density"]) == (workload, d)])
      for workload, d in _panels(runs)
    ]
    band = (0.97, 1.03) if field == "transmitted" else None
    fig = plots.training_panels(panels, ylabel, band)
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
      "`python -m benchmarks.training_options`: each model trained on 8 simulated workers "
      f"for {options['rows'][0]['steps']} steps with the same batches per variant "
      "(the demo's trainer). *warm-up*: `density=exdyna_jax.dgc_warmup(d, "
      "steps_per_level=25)` (25 %, 6.25 %, 1.56 %, ... then `d`, 25 steps each); "
      "*bf16 values*: `value_dtype=\"bfloat16\"`. Bytes: mean per worker per step, "
      "the library's count (it follows the warm-up's levels); ratio to dense.\n\n"
      + table(["model", "d", "variant", "metric", "value", "vs dense", "density sent",
                "bytes/step", "bytes vs dense"], rows)
      + f"\n\nOne ExDyna step at N = {short(wire['num_elements'])}, n = 8, d = 0.001 "
      f"sends {f32:,} bytes per worker with float32 values and {bf16:,} with bfloat16 "
      f"({bf16 / f32:.3f}): the index all-gather is unchanged, the value all-reduce "
      "halves. (XLA's CPU backend widens a bfloat16 all-reduce to float32 before "
      "reducing; GPU collectives keep it.)"
  )
