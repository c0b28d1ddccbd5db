"""The per-worker update step on one accelerator: ExDyna against the floor and Top-k.

Eight workers are simulated with ``jax.vmap(axis_name="data", axis_size=8)``
on the one device (so every worker's partition is an eighth of ``N``, as on
8 GPUs); the collectives become local copies. Every time reported is the
whole 8-worker step divided by 8: one worker's share. Each step is the one a
user runs: jitted, the state donated and returned first.

Methods (all on the same gradients):

==================  ==========================================================
exdyna              ``exdyna(d)``, the default (balanced, adaptive)
exdyna_reference    ``exdyna(d, controller="reference")``
micro               ``micro(d)``
topk_ef             a plain error-feedback step with ``lax.top_k``: read
                    ``a = g + m``, top-k of ``|a|``, write ``m`` and the update
floor               the elementwise floor: read ``g`` and ``m``, write ``m``
                    and a dense update (16 N bytes), timed as a program, and
                    as 16 N bytes at the copy bandwidth measured on the device
==================  ==========================================================

Writes ``results/gpu.json`` (``device``, ``exdyna_over_floor`` and
``topk_over_exdyna`` at N = 25M, d = 0.001, and the full table) unless
``--out`` says otherwise. ``--quick`` runs small sizes (for CPU and tests).

Run: python -m benchmarks.gpu [--quick] [--out FILE] [--repeats 20] [--methods a,b,...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import exdyna_jax

AXIS = "data"
WORKERS = 8
TARGET = {"elements": 25_000_000, "density": 0.001}
FULL_GRID = [(n, d) for n in (11_200_000, 25_000_000, 100_000_000) for d in (0.01, 0.001)]
QUICK_GRID = [(200_000, 0.001)]
METHODS = ("exdyna", "exdyna_reference", "micro", "topk_ef", "floor")


def sparsifier(name, density):
  if name == "exdyna":
    return exdyna_jax.exdyna(density, axis_name=AXIS)
  if name == "exdyna_reference":
    return exdyna_jax.exdyna(density, axis_name=AXIS, controller="reference")
  return exdyna_jax.micro(density, axis_name=AXIS)


def program(name, num_elements, density):
  """``(init(params) -> state, step(state, grads) -> (state, update))``, per worker."""
  params = jnp.zeros((num_elements,), jnp.float32)
  if name == "floor":
    def floor_step(residual, grads):
      accumulated = grads + residual
      return accumulated * 0.5, accumulated * 0.5  # new residual, dense update
    return lambda: jnp.zeros_like(params), floor_step
  if name == "topk_ef":
    k = int(density * num_elements)

    def topk_step(residual, grads):
      accumulated = grads + residual
      _, indices = jax.lax.top_k(jnp.abs(accumulated), k)
      values = jax.lax.psum(accumulated[indices], AXIS) / WORKERS
      update = jnp.zeros_like(accumulated).at[indices].set(values)
      return accumulated.at[indices].set(0.0), update
    return lambda: jnp.zeros_like(params), topk_step
  tx = sparsifier(name, density)

  def step(state, grads):
    update, state = tx.update(grads, state, params)
    return state, update
  return lambda: tx.init(params), step


def time_method(name, num_elements, density, grads, repeats):
  init, step = program(name, num_elements, density)
  vmapped = jax.vmap(step, axis_name=AXIS, axis_size=WORKERS)
  run = jax.jit(vmapped, donate_argnums=0)
  state = jax.jit(jax.vmap(lambda _: init(), axis_name=AXIS, axis_size=WORKERS))(
      jnp.arange(WORKERS)
  )
  for _ in range(3):  # compile and warm up
    state, update = run(state, grads)
  jax.block_until_ready((state, update))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, update = run(state, grads)
    jax.block_until_ready((state, update))
    times.append((time.perf_counter() - start) / WORKERS)
  result = {"seconds": statistics.median(times), "min_seconds": min(times)}
  if name not in ("floor", "topk_ef"):
    stats = exdyna_jax.get_stats(state)
    k = int(density * num_elements)
    result["sent_over_k"] = float(stats.transmitted[0]) / k
  return result


def copy_bandwidth(num_elements, repeats):
  """Bytes per second of ``y = x + 1`` over ``8 N`` float32 (read and write)."""
  x = jnp.ones((WORKERS * num_elements,), jnp.float32)
  bump = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  for _ in range(3):
    x = bump(x)
  x.block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    x = bump(x)
    x.block_until_ready()
    times.append(time.perf_counter() - start)
  return 8 * WORKERS * num_elements / statistics.median(times)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, for CPU and tests")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--out", default=None, help="JSON (default: results/gpu.json)")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="comma-separated subset (exdyna, topk_ef and floor give the ratios)")
  args = parser.parse_args(argv)
  methods = args.methods.split(",")
  unknown = set(methods) - set(METHODS) or {"exdyna", "topk_ef", "floor"} - set(methods)
  if unknown:
    parser.error(f"--methods: {sorted(unknown)} unknown or missing; choose from {METHODS}, "
                 "with exdyna, topk_ef and floor")
  grid = QUICK_GRID if args.quick else FULL_GRID
  device = jax.devices()[0]
  rows = []
  for num_elements, density in grid:
    grads = jax.random.normal(jax.random.key(0), (WORKERS, num_elements), jnp.float32)
    bandwidth = copy_bandwidth(num_elements, args.repeats)
    row = {"elements": num_elements, "density": density, "workers": WORKERS,
           "copy_bandwidth_bytes_per_second": bandwidth,
           "floor_bandwidth_seconds": 16 * num_elements / bandwidth}
    for name in methods:
      row[name] = time_method(name, num_elements, density, grads, args.repeats)
      print(f"N={num_elements:,} d={density} {name}: {1e3 * row[name]['seconds']:.3f} ms",
            file=sys.stderr, flush=True)
    exdyna = row["exdyna"]["seconds"]
    row["exdyna_over_floor"] = exdyna / row["floor"]["seconds"]
    row["exdyna_over_floor_bandwidth"] = exdyna / row["floor_bandwidth_seconds"]
    row["topk_over_exdyna"] = row["topk_ef"]["seconds"] / exdyna
    rows.append(row)
  target = next((r for r in rows if all(r[k] == v for k, v in TARGET.items())), rows[-1])
  result = {
      "benchmark": "gpu",
      "device": device.device_kind,
      "platform": device.platform,
      "quick": args.quick,
      "timing": "8 workers simulated with jax.vmap on one device; one worker's share "
                "(the whole step / 8); jitted, state donated",
      "at": {"elements": target["elements"], "density": target["density"]},
      "exdyna_over_floor": target["exdyna_over_floor"],
      "topk_over_exdyna": target["topk_over_exdyna"],
      "rows": rows,
  }
  out = pathlib.Path(args.out) if args.out else (
      pathlib.Path(__file__).resolve().parent / "results" / "gpu.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  print(json.dumps({k: result[k] for k in ("device", "exdyna_over_floor", "topk_over_exdyna")}))
  return result


if __name__ == "__main__":
  main()
