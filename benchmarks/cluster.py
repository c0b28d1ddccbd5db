"""The train step on an emulated cluster: worker processes behind shaped links.

Run (as root, or in an unprivileged user namespace; see docs/multihost.md):

  python -m benchmarks.cluster [--quick] [--workers 2,4,8] [--rates 100mbit,1gbit,unshaped]

For each worker count ``n`` and link rate, ``python -m exdyna_jax.launch
--processes n --link-rate RATE`` runs `cluster_worker.py`, which times the
donated ``data_parallel(...).step`` a user runs for every method on the
same MLP (4.7M parameters, 32 examples per worker, d = 0.001), and calibrates
the link with ``psum`` and ``all_gather`` of 16 B to 4 MB. Once per ``n``
the same step runs in one process on ``n`` CPU devices, where collectives
cost next to nothing: it splits each cluster step into

* ``compute``: the gradient and SGD with no exchange (the ``compute`` row),
* the sparsifier's own work: the local step minus the local compute,
* the exchange: the cluster step minus the local step.

Three rows are floors, not methods (`cluster_worker.FLOORS`):
``exdyna_network_rounds`` runs compute and the collectives of ExDyna's
compiled step (told the network) with no other work, what any step with its
rounds takes here; ``exdyna_network_two_rounds`` the same without the
guard's round; ``exdyna_network_shell`` the library's error-feedback shell
around the same collectives, the values taken at indices chosen for free,
what any error-feedback method with those rounds takes.

Every process shares this machine's cores, as the devices of the local run
do, so the split compares like with like. Also written: each method's
crossover link rate (above it dense's step, ``a + b / rate`` through the
two slowest links, is the shorter) and the alpha-beta model of
its collectives (`exdyna_jax.hlo` ring counts of the compiled step,
``alpha`` and the bandwidth fitted to the calibration) against the measured
exchange.

Targets (``--parts targets``): 4 processes at 1 Gb/s and unshaped time
compute only, dense, ExDyna told the network, Top-k and the floors three
times each, interleaved in one launch; the REPORT's step targets read the
means of these repeats (a single launch is too noisy on two cores).

Hierarchical (``--parts hierarchical``): 4 processes of 2 devices each, at
1 Gb/s and unshaped, time compute only, dense and ExDyna over all 8 devices
and ExDyna across the processes only, ``hierarchical(exdyna(axis_name="node"),
fast_axis="local")`` with the in-process reduction a ``psum`` or a
``psum_scatter`` (`cluster_worker.py`'s ``hierarchical_psum`` and
``hierarchical``).

Time to accuracy (``--parts accuracy``): 4 processes at 1 Gb/s and unshaped
train the digits with the demo's `exdyna_jax.demo.cluster_worker` (an MLP 64-2048-2048-10,
4.3M parameters, d = 0.01; ExDyna told the network the workers measure,
``Network.measure``): dense for ``--accuracy-steps`` steps, then each other method
for as many seconds; the test accuracy against wall-clock seconds, and when
each first reaches dense's final score.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from benchmarks import _common
from exdyna_jax.demo import cluster
from exdyna_jax.launch import _shaped_links

WORKER = [sys.executable, "-m", "benchmarks.cluster_worker"]
# The demo's worker and settings (`exdyna-jax demo --processes 4 --method exdyna topk`).
ACCURACY_WORKER = [sys.executable, "-m", cluster.WORKER_MODULE, "--task=digits-wide",
                   "--variants=dense,exdyna,exdyna_warmup,topk"]
# ExDyna is told the network the workers time first (`exdyna_jax.Network.measure`,
# the demo's --network measure), as docs/multihost.md advises where messages are dear.
ACCURACY_CONFIG = {"density": 0.01, "eval_every": 10, "network": "measure"}
ACCURACY_WORKERS, ACCURACY_RATES = 4, ("1gbit", "unshaped")
RATES = ("100mbit", "1gbit", "unshaped")
WORKERS = (2, 4, 8)
# The targets' runs: n = 4, these variants interleaved TARGET_REPEATS times in one launch.
TARGET_WORKERS, TARGET_RATES, TARGET_REPEATS, TARGET_STEPS = 4, ("1gbit", "unshaped"), 3, 20
TARGET_VARIANTS = ("compute", "dense", "exdyna", "exdyna_network", "topk", "exdyna_network_rounds",
                   "exdyna_network_two_rounds", "exdyna_network_shell")
HIERARCHICAL_PROCESSES, HIERARCHICAL_DEVICES = 4, 2
HIERARCHICAL_RATES = ("1gbit", "unshaped")
HIERARCHICAL_VARIANTS = ("compute", "dense", "exdyna", "hierarchical_psum", "hierarchical")
STEP_VARIANTS = ("compute", "dense", "exdyna", "exdyna_network", "exdyna_nospill",
                 "exdyna_reference", "micro", "spardl", "topk", "cltk", "hard_threshold",
                 "exdyna_network_rounds", "exdyna_network_two_rounds", "exdyna_network_shell")


def fit_link(calibration: list[dict]) -> dict:
  """``alpha`` (s per message) and bandwidth (bit/s) of ``seconds = alpha m + 8 bytes / B``.

  ``alpha`` from the smallest transfers (at most 4 KB per worker), where bytes
  take no time; the bandwidth from the largest of each kind, less their alpha.
  """
  small = [row["seconds"] / row["messages"] for row in calibration if row["bytes"] <= 4096]
  alpha = float(np.median(small))
  rates = []
  for kind in {row["kind"] for row in calibration}:
    row = max((r for r in calibration if r["kind"] == kind), key=lambda r: r["bytes"])
    rates.append(8 * row["bytes"] / max(row["seconds"] - alpha * row["messages"], 1e-9))
  return {"alpha_s": alpha, "bandwidth_bps": float(np.median(rates))}


def predict_exchange(collectives: list[dict], link: dict) -> float:
  """Alpha-beta seconds of one step's collectives on the fitted link."""
  per_bit = 0.0 if not link["bandwidth_bps"] else 1 / link["bandwidth_bps"]
  return sum(op["messages"] * link["alpha_s"] + 8 * op["bytes"] * per_bit for op in collectives)


def crossover(dense_slow: tuple[float, float], dense_fast: tuple[float, float],
              step_ms: float) -> float | None:
  """The link rate (bit/s) above which dense's step is shorter than ``step_ms``.

  Dense's step is ``a + b / rate`` through its two ``(rate, ms)`` points; a
  sparse step hardly depends on the rate, so it is one number (its mean over
  the links). None where dense is slower at any rate (``step_ms <= a``).
  """
  (rate_slow, slow), (rate_fast, fast) = dense_slow, dense_fast
  per_bit = (slow - fast) / (1 / rate_slow - 1 / rate_fast)
  fixed = slow - per_bit / rate_slow
  return None if step_ms <= fixed else per_bit / (step_ms - fixed)


def summarize(runs: dict) -> dict:
  """Breakdown, crossovers and the model's error, from the raw runs."""
  out = {}
  for workers, by_rate in runs.items():
    local = {r["variant"]: r for r in by_rate["local"] if "variant" in r}
    compute_local = local["compute"]["mean_ms"]
    rows = {}
    for rate, records in by_rate.items():
      if rate == "local":
        continue
      link = fit_link(next(r["calibration"] for r in records if "calibration" in r))
      for record in records:
        if "variant" not in record:
          continue
        variant = record["variant"]
        measured = record["mean_ms"] - local[variant]["mean_ms"]
        rows.setdefault(variant, {})[rate] = {
            "step_ms": record["mean_ms"],
            "median_ms": record["median_ms"],
            "local_ms": local[variant]["mean_ms"],
            "sparsifier_ms": local[variant]["mean_ms"] - compute_local,
            "exchange_ms": measured,
            "model_exchange_ms": 1e3 * predict_exchange(record["collectives"], link),
            "rounds": len(record["collectives"]),
            "bytes_sent": record.get("bytes_sent"),
            "link": link,
        }
    shaped = sorted((r for r in by_rate if r not in ("local", "unshaped")),
                    key=_shaped_links.parse_rate)
    if len(shaped) >= 2 and "dense" in rows:
      dense = [(_shaped_links.parse_rate(rate), rows["dense"][rate]["step_ms"])
               for rate in shaped[:2]]
      for variant, by in rows.items():
        if variant not in ("dense", "compute"):
          mean = float(np.mean([row["step_ms"] for row in by.values()]))
          by["crossover_bps"] = crossover(*dense, mean)
    out[str(workers)] = rows
  return out


PART_KEYS = {"steps": "runs", "targets": "targets", "hierarchical": "hierarchical",
             "accuracy": "time_to_accuracy"}
"""Each part of ``--parts`` that runs, and the key of ``cluster.json`` it writes."""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workers", default=",".join(map(str, WORKERS)))
  parser.add_argument("--rates", default=",".join(RATES))
  parser.add_argument("--variants", default=",".join(STEP_VARIANTS))
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--parts", default="steps,targets,hierarchical,accuracy",
                      help="steps (the step-time grid), targets (the targets' point, n = 4, "
                      "repeated), hierarchical (2 devices per process), "
                      "accuracy (time to accuracy), "
                      "summary (recomputed from the runs in --out); a part not run is kept")
  parser.add_argument("--accuracy-steps", type=int, default=300, help="dense's training steps")
  parser.add_argument("--quick", action="store_true", help="2 workers, 1gbit, 3 variants, 3 steps")
  parser.add_argument("--timeout", type=float, default=1500.0)
  parser.add_argument("--out", default=str(_common.RESULTS / "cluster.json"))
  args = parser.parse_args()
  if args.quick:
    args.workers, args.rates, args.variants, args.steps = "2", "1gbit", "compute,dense,exdyna", 3
  parts = args.parts.split(",")
  out = pathlib.Path(args.out)
  earlier = json.loads(out.read_text()) if out.exists() else {}
  result = {key: value for key, value in earlier.items() if key not in ("machine", "dates")}
  # When each part ran: one kept from an earlier run keeps its date ("machine" is this run's).
  dates = earlier.get("dates") or {part: earlier["machine"]["date_utc"]
                                   for part, key in PART_KEYS.items() if key in earlier}
  dates.update(dict.fromkeys(set(parts) & set(PART_KEYS), _common.utc_now()))
  if "steps" in parts:
    runs = step_grid(args)
    result.update(runs={str(k): v for k, v in runs.items()}, summary=summarize(runs))
  if "summary" in parts and "runs" in result:  # again, from the runs kept
    result["summary"] = summarize({int(k): v for k, v in result["runs"].items()})
  if "targets" in parts:
    result["targets"] = target_runs(args)
  if "hierarchical" in parts:
    result["hierarchical"] = hierarchical_runs(args)
  if "accuracy" in parts:
    steps, command = args.accuracy_steps, ACCURACY_WORKER
    if args.quick:
      steps, command = 20, [*ACCURACY_WORKER, "--variants=dense,exdyna"]
    config = json.dumps({**ACCURACY_CONFIG, "steps": steps})
    result["time_to_accuracy_config"] = json.loads(config)
    result["time_to_accuracy"] = {
        rate: cluster.run_workers([*command, f"--config={config}"], processes=ACCURACY_WORKERS,
                                  link_rate=rate, timeout=args.timeout)
        for rate in (ACCURACY_RATES[:1] if args.quick else ACCURACY_RATES)
    }
  _common.write_json(out, {**result, "dates": dates})


def step_grid(args) -> dict:
  """The step-time runs: ``{n: {"local": records, rate: records}}``."""
  worker_args = [f"--variants={args.variants}", f"--steps={args.steps}"]
  runs: dict = {}
  for workers in map(int, args.workers.split(",")):
    _common.log(f"n = {workers}: one process of {workers} devices")
    runs[workers] = {"local": cluster.run_workers(
        [*WORKER, *worker_args], processes=1, devices_per_process=workers, link_rate=None,
        timeout=args.timeout)}
    for rate in args.rates.split(","):
      _common.log(f"n = {workers}: {workers} processes at {rate}")
      runs[workers][rate] = cluster.run_workers(
          [*WORKER, *worker_args, "--calibrate"], processes=workers, link_rate=rate,
          timeout=args.timeout)
  return runs


def target_runs(args) -> dict:
  """``{rate: records}`` at the targets' point: `TARGET_VARIANTS`, `TARGET_REPEATS` times.

  A grid's launch times each method once, and at ``n = 4`` on these two
  cores one launch can run a method 2x slower than the next (compute only:
  20 to 43 ms); the targets read the mean of interleaved repeats instead.
  """
  variants = ",".join(TARGET_VARIANTS * (1 if args.quick else TARGET_REPEATS))
  command = [*WORKER, f"--variants={variants}", f"--steps={TARGET_STEPS}"]
  runs = {}
  for rate in TARGET_RATES:
    _common.log(f"targets: {TARGET_WORKERS} processes at {rate}, {variants}")
    runs[rate] = cluster.run_workers(command, processes=TARGET_WORKERS, link_rate=rate,
                                     timeout=args.timeout)
  return runs


def hierarchical_runs(args) -> dict:
  """``{rate: records}``: `HIERARCHICAL_PROCESSES` processes of `HIERARCHICAL_DEVICES` each."""
  variants = ("compute", "hierarchical_psum") if args.quick else HIERARCHICAL_VARIANTS
  command = [*WORKER, f"--variants={','.join(variants)}", f"--steps={args.steps}"]
  runs = {}
  for rate in HIERARCHICAL_RATES[:1] if args.quick else HIERARCHICAL_RATES:
    _common.log(f"hierarchical: {HIERARCHICAL_PROCESSES} processes of {HIERARCHICAL_DEVICES} "
                f"devices at {rate}")
    runs[rate] = cluster.run_workers(
        command, processes=HIERARCHICAL_PROCESSES, devices_per_process=HIERARCHICAL_DEVICES,
        link_rate=rate, timeout=args.timeout)
  return runs


if __name__ == "__main__":
  main()
