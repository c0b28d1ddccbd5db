"""Section 3: the alpha-beta model of many workers, and the two-level exchange."""

from __future__ import annotations

import numpy as np

from benchmarks import _common
from benchmarks.report import plots
from benchmarks.report._format import Report, ms, table
from benchmarks.report.traffic import curves_by_method

# -------------------------------------------------------------------- 3. scale model


def scale_section(rep: Report, scale: dict | None, collectives: dict | None) -> None:
  title = "## 3. Scale model: communication time per step, n = 8 to 1024"
  if not rep.begin(title, scale, "scale_model.json"):
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
    for link in ("25",):  # the plot has the others
      rows = []
      for name in _common.METHODS:
        by_n = {p["workers"]: p for p in preds if p["method"] == name and p["density"] == density}
        if not by_n:
          continue  # not measured in this run
        rows.append([name] + [ms(by_n[n]["seconds"][link]) if n in by_n else "" for n in ns])
      rep.add(
        f"### Predicted ms per step, d = {density}, {link} Gb/s\n\n"
        + table(["method", *[f"n={n}" for n in ns]], rows)
      )
  panels = [[(f"{link} Gb/s, d = {density}",
              curves_by_method(preds, density, lambda p, link=link: p["seconds"][link] * 1e3))
             for link in (str(x) for x in scale["links_gbps"])] for density in densities]
  fig = plots.method_curves(panels, "ms per step (model)", (15, 3.6 * len(densities)))
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
    + table(
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
    if c["density"] == 0.01  # d = 0.001: `collectives.json`
  ]
  if rows:
    errors = [abs(c["measured_over_predicted"] - 1) for c in collectives["replays"]]
    rep.add(
      table(
        ["method", "d", "ops", "ring bytes", "measured ms", "model ms", "measured / model"], rows
      )
      + f"\n\nMedian |measured / model - 1| over the replays: {100 * np.median(errors):.0f} %."
    )

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
  methods = [m for m in ("exdyna", "topk", "dense") if any(p["method"] == m for p in preds)]
  density = min({p["density"] for p in preds})
  for local, link_name in ((8, "nvlink"),):  # other layouts: `scale_model.json`
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
          cells = [ms(by_n[n]["seconds"]["25"]) if n in by_n else "" for n in ns]
          rows.append([name, mode, *cells])
    if rows:
      rep.add(
        f"#### Predicted ms per step, L = {local}, {link_name} inside hosts, 25 Gb/s "
        f"between hosts, d = {density} (other methods, links and densities: `scale_model.json`)\n\n"
        + table(["method", "mode", *[f"n={n} (H={n // local})" for n in ns]], rows)
      )
