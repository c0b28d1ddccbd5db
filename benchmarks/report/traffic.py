"""Section 2: the bytes of each method's compiled exchange."""

from __future__ import annotations

from benchmarks import _common
from benchmarks.report import plots
from benchmarks.report._format import Report, short, table

# ------------------------------------------------------------------------ 2. traffic


def traffic_section(rep: Report, traffic: dict | None) -> None:
  title = "## 2. Traffic: bytes per worker per step, from the compiled HLO"
  if not rep.begin(title, traffic, "traffic.json"):
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
      if not any((name, density, n) in rows_by for n in small):
        continue  # not measured in this run
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
      + table(
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
  ops8 = [  # the other methods' ops: `traffic.json`
    r for r in traffic["rows"] if r["workers"] == 8 and r["density"] == traffic["densities"][0]
    and r["method"] in ("exdyna", "topk", "dense")
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
    f"### The collectives of one step, n = 8, d = {traffic['densities'][0]} "
    "(ExDyna, Top-k and dense; the others in `traffic.json`)\n\n"
    + table(["method", "op", "result shape", "inside", "bytes sent", "ring messages"], rows)
  )
  panels = [(f"d = {density}, N = {short(size)} (from compiled HLO)",
             curves_by_method(traffic["rows"], density, lambda r: r["bytes"]))
            for density in traffic["densities"]]
  fig = plots.method_curves([panels], "bytes sent per worker per step", (11, 4))
  rep.add(rep.save_plot(fig, "traffic.png"))


def curves_by_method(rows: list[dict], density: float, value) -> plots.Curves:
  """Each registered method's ``value(row)`` against n at ``density``."""
  curves = {}
  for name in _common.METHODS:
    points = sorted((r["workers"], value(r)) for r in rows
                    if r["method"] == name and r["density"] == density)
    if points:
      curves[name] = points
  return curves
