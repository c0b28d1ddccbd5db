"""Section 8: the update and the train step on one GPU (`benchmarks/gpu.py`)."""

from __future__ import annotations

from benchmarks.report._format import Report, short, table

UPDATE_METHODS = ("exdyna", "exdyna_reference", "micro", "topk_ef", "floor")
PROFILE_ITEMS = 8


def gpu_section(rep: Report, gpu: dict | None) -> None:
  title = "## 8. One GPU: the update and the train step (`benchmarks/gpu.py`)"
  if not rep.begin(title, gpu, "gpu.json"):
    return
  rep.add(
    f"{gpu['device']} ({gpu['platform']}, jax {gpu.get('jax', '?')}). {gpu['timing']}. "
    "Milliseconds per worker, each step blocked on (the host's dispatch and wait "
    "included); `exdyna queued` is ExDyna with the steps queued (the device's rate). "
    "`floor` is the elementwise floor as a program (read the gradient and the residual, "
    "write the residual and the update), `16N B` the same bytes at the copy bandwidth "
    "measured in the row (`y = x + 1` in place, queued): the floor the targets use."
  )
  rows = []
  for r in gpu["rows"]:
    methods = [m for m in UPDATE_METHODS if m in r]
    rows.append([
      short(r["elements"]), r["density"],
      *(f"{1e3 * r[m]['seconds']:.3f}" for m in methods),
      f"{1e3 * r['exdyna']['queued_seconds']:.3f}",
      f"{1e3 * r['floor_bandwidth_seconds']:.3f}",
      f"{r['exdyna_over_floor']:.2f}", f"{r['exdyna_queued_over_floor']:.2f}",
      f"{r['exdyna_over_floor_program']:.2f}", f"{r['topk_over_exdyna']:.1f}",
    ])
  methods = [m for m in UPDATE_METHODS if m in gpu["rows"][0]]
  rep.add(table(["N", "d", *methods, "exdyna queued", "16N B", "exdyna / 16N B",
                 "queued / 16N B", "exdyna / floor", "topk_ef / exdyna"], rows))
  at = gpu["at"]
  where = f"N = {short(at['elements'])}, d = {at['density']}"
  rep.target(f"GPU: exdyna / elementwise floor, 16 N bytes ({where})", "<= 2",
             f"{gpu['exdyna_over_floor']:.2f}", gpu["exdyna_over_floor"] <= 2)
  rep.target(f"GPU: topk_ef / exdyna ({where})", ">= 20",
             f"{gpu['topk_over_exdyna']:.1f}", gpu["topk_over_exdyna"] >= 20)
  if "chunk_scales" in gpu:
    rep.add(
      "ExDyna at the target with the partition read in chunks of a multiple of "
      "`_selection.chunk_length` (fewer loop iterations, more elements read past the "
      "partition's ends):\n\n"
      + table(["chunk scale", "chunk", "ms per worker"],
              [[scale, f"{row['chunk']:,}", f"{1e3 * row['seconds']:.3f}"]
               for scale, row in gpu["chunk_scales"].items()])
    )
  if "train" in gpu:
    train_table(rep, gpu["train"])
  for thread, summary in gpu.get("profile", {}).get("exdyna", {}).items():
    rep.add(
      f"Profile of `exdyna` at the target ({thread}): "
      f"{summary['events_per_step']:.0f} device events, "
      f"{summary['device_to_host_per_step']:.0f} device-to-host copies (each a wait "
      f"of the host) and {summary['busy_us_per_step']:,.0f} us busy in a span of "
      f"{summary['span_us_per_step']:,.0f} us per 8-worker step (queued, under the "
      "profiler); the busiest:\n\n"
      + table(["operation", "from", "per step", "us per step"],
              [[f"`{t['name'][:60]}`", f"`{t['source']}`" if t.get("source") else "",
                f"{t['count_per_step']:g}", f"{t['us_per_step']:,.0f}"]
               for t in summary["top"][:PROFILE_ITEMS]])
    )


def train_table(rep: Report, train: dict) -> None:
  names = [n for n in ("compute", "dense", "exdyna", "topk") if n in train]
  rep.add(
    f"The whole train step: an MLP {'-'.join(map(str, train['layers']))} "
    f"({train['parameters']:,} parameters), {train['workers']} workers under `vmap` with "
    f"{train['batch_per_worker']} examples each, `optax.chain(method, optax.sgd)`, d = "
    f"{train['density']}, params and state donated; the collectives are copies on the one "
    "device, so no method pays a network here.\n\n"
    + table(["method", "ms per 8-worker step", "/ compute"],
            [[n, f"{1e3 * train[n]['seconds']:.2f}",
              f"{train[n]['seconds'] / train['compute']['seconds']:.2f}"] for n in names])
  )
