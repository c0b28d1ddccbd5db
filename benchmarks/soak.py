"""Soak test: thousands of steps of a small model for every method, watching for drift.

Each method trains a 32-32-8 MLP (1,320 parameters) on a synthetic regression
task with ``n`` workers on real (forced CPU) devices under ``jax.shard_map``.
Every device keeps its *own* copy of the parameters for the whole run (they
are never re-synchronised), so any disagreement between the workers' updates
would show up as diverged copies. Steps run in jitted chunks of
``lax.scan``; after every chunk the script checks that

* the threshold is finite and positive (0 for dense),
* the partitions are within bounds (sizes at least the minimum, covering the
  vector exactly, starts consistent),
* no step was skipped for non-finite gradients,
* every worker's residual norm is finite and, over the second half of the
  run, no larger than ``RESIDUAL_GROWTH`` times its maximum over the first
  half (the residual is bounded, not drifting),
* the devices' parameter copies are bit-identical.

Usage::

  python -m benchmarks.soak                       # 10,000 steps, every method
  python -m benchmarks.soak --steps 500 --methods exdyna micro --out soak.json

``tests/test_soak.py`` runs a short version in the test suite.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time

import jax

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax
from jax import P

import exdyna_jax

AXIS = "data"
SIZES = (32, 32, 8)
BATCH = 16
DENSITY = 0.02
NUM_BLOCKS = 16
LEARNING_RATE = 0.02
RESIDUAL_GROWTH = 2.0
OPTIONS = {"exdyna": {"density": DENSITY, "num_blocks": NUM_BLOCKS}, "dense": {}}


def init_params(key):
  keys = jax.random.split(key, len(SIZES) - 1)
  return {
    f"layer{i}": {
      "w": jax.random.normal(k, (a, b)) / math.sqrt(a),
      "b": jnp.zeros((b,)),
    }
    for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:], strict=True))
  }


def forward(params, x):
  for i in range(len(SIZES) - 1):
    layer = params[f"layer{i}"]
    x = x @ layer["w"] + layer["b"]
    if i < len(SIZES) - 2:
      x = jnp.tanh(x)
  return x


def loss_fn(params, teacher, key):
  """Mean squared error against a fixed teacher on a fresh batch (noisy labels)."""
  x_key, noise_key = jax.random.split(key)
  x = jax.random.t(x_key, 3.0, (BATCH, SIZES[0]))
  y = forward(teacher, x) + 0.1 * jax.random.normal(noise_key, (BATCH, SIZES[-1]))
  return jnp.mean((forward(params, x) - y) ** 2)


def make_tx(method: str) -> optax.GradientTransformation:
  sparsifier = exdyna_jax.get_sparsifier(method, **OPTIONS.get(method, {"density": DENSITY}))
  return optax.chain(sparsifier, optax.sgd(LEARNING_RATE, momentum=0.9))


def build(method: str, num_workers: int, chunk: int):
  """``(init, run_chunk)`` on a mesh of ``num_workers`` devices.

  Params, state and per-step records all carry a leading worker axis sharded
  over the mesh: nothing is ever replicated by construction.
  """
  tx = make_tx(method)
  mesh = jax.make_mesh(
    (num_workers,),
    (AXIS,),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=jax.devices()[:num_workers],
  )
  add = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
  drop = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731

  def init(params):
    return add(params), add(tx.init(params))

  def run_chunk(params, opt_state, teacher, first_step):
    params, opt_state = drop(params), drop(opt_state)
    worker = jax.lax.axis_index(AXIS)

    def step(carry, t):
      params, opt_state = carry
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), t), worker)
      loss, grads = jax.value_and_grad(loss_fn)(params, teacher, key)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      stats = exdyna_jax.get_stats(opt_state)
      residual = optax.tree.get(opt_state, "residual", default=jnp.zeros((1,)))
      record = {
        "loss": jax.lax.pmean(loss, AXIS),
        "residual_norm": jnp.linalg.norm(residual),
        "stats": stats,
      }
      return (params, opt_state), record

    steps = first_step + jnp.arange(chunk)
    (params, opt_state), records = jax.lax.scan(step, (params, opt_state), steps)
    return add(params), add(opt_state), add(records)

  sharded = P(AXIS)
  per_worker = functools.partial(jax.shard_map, mesh=mesh, out_specs=sharded)
  init = per_worker(init, in_specs=P())
  run_chunk = per_worker(run_chunk, in_specs=(sharded, sharded, P(), P()), check_vma=False)
  return jax.jit(init), jax.jit(run_chunk)


def check_chunk(method: str, records, params, num_elements: int, num_workers: int) -> list[str]:
  """Problems found in one chunk's records (``[n, chunk, ...]``); empty if none."""
  problems = []
  stats = records["stats"]
  threshold = stats.threshold
  if not np.isfinite(threshold).all():
    problems.append("non-finite threshold")
  elif method == "dense":
    if (threshold != 0).any():
      problems.append("dense threshold not 0")
  elif (threshold <= 0).any():
    problems.append(f"threshold <= 0 (min {threshold.min()})")
  sizes, starts = stats.partition_sizes, stats.partition_starts
  if method in ("exdyna", "micro"):
    units = NUM_BLOCKS if method == "exdyna" else num_elements
    minimum = max(1, NUM_BLOCKS // (4 * num_workers)) if method == "exdyna" else 1
    if (sizes < minimum).any() or (sizes.sum(axis=-1) != units).any():
      problems.append(f"partition sizes out of bounds: {sizes.min()}..{sizes.max()}")
    if (starts[..., 1:] != np.cumsum(sizes, axis=-1)[..., :-1]).any() or (
      starts[..., 0] != 0
    ).any():
      problems.append("partition starts inconsistent with sizes")
  elif method == "spardl":
    if (sizes.sum(axis=-1) != num_elements).any():
      problems.append("SparDL blocks do not cover the vector")
  elif (starts != 0).any() or (sizes != num_elements).any():
    problems.append("unpartitioned method reports partitions")
  if (stats.skipped_steps != 0).any():
    problems.append(f"{stats.skipped_steps.max()} steps skipped for non-finite gradients")
  if not np.isfinite(records["residual_norm"]).all():
    problems.append("non-finite residual")
  for leaf in jax.tree.leaves(params):
    if (leaf != leaf[:1]).any():
      problems.append("devices diverged: parameter copies differ")
      break
  for field in (threshold, stats.transmitted):
    if (field != field[:1]).any():
      problems.append("devices disagree on the stats")
      break
  return problems


def soak(method: str, *, steps: int, num_workers: int = 4, chunk: int = 500) -> dict:
  """Runs ``steps`` steps of ``method``; returns its figures (``problems`` empty if sound)."""
  chunk = min(chunk, steps)
  init, run_chunk = build(method, num_workers, chunk)
  teacher = init_params(jax.random.key(1))
  params, opt_state = init(init_params(jax.random.key(2)))
  num_elements = sum(x.size for x in jax.tree.leaves(teacher))
  k = math.floor(DENSITY * num_elements)
  losses, residual_norms, ratios, selected, problems = [], [], [], [], []
  thresholds = [math.inf, -math.inf]
  start = time.perf_counter()
  for first in range(0, steps, chunk):
    params, opt_state, records = run_chunk(params, opt_state, teacher, jnp.int32(first))
    records, host_params = jax.tree.map(np.asarray, (records, params))
    problems += [
      f"steps {first}-{first + chunk}: {p}"
      for p in check_chunk(method, records, host_params, num_elements, num_workers)
    ]
    losses.append(records["loss"][0])
    residual_norms.append(records["residual_norm"].max(axis=0))
    ratios.append(records["stats"].transmitted[0] / k)
    selected.append(records["stats"].selected[0] / k)
    thresholds = [
      min(thresholds[0], float(records["stats"].threshold.min())),
      max(thresholds[1], float(records["stats"].threshold.max())),
    ]
  seconds = time.perf_counter() - start
  losses, residual_norms, ratios, selected = map(
    np.concatenate, (losses, residual_norms, ratios, selected)
  )
  half = len(residual_norms) // 2
  first_half_max = float(residual_norms[:half].max()) if half else 0.0
  second_half_max = float(residual_norms[half:].max())
  if second_half_max > RESIDUAL_GROWTH * first_half_max and method != "dense":
    problems.append(
      f"residual norm grew: max {second_half_max:.4g} in the second half against "
      f"{first_half_max:.4g} in the first"
    )
  tail = slice(len(losses) * 9 // 10, None)
  return {
    "method": method,
    "steps": steps,
    "workers": num_workers,
    "elements": num_elements,
    "seconds": round(seconds, 2),
    "loss_first_100": float(losses[:100].mean()),
    "loss_last_10pct": float(losses[tail].mean()),
    "threshold_min": thresholds[0],
    "threshold_max": thresholds[1],
    "residual_norm_max_first_half": first_half_max,
    "residual_norm_max_second_half": second_half_max,
    "residual_norm_final": float(residual_norms[-1]),
    "selected_over_k_median_last_10pct": float(np.median(selected[tail])),
    "transmitted_over_k_median_last_10pct": float(np.median(ratios[tail])),
    "problems": problems,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10_000)
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--chunk", type=int, default=500)
  parser.add_argument("--methods", nargs="*", default=list(exdyna_jax.available_sparsifiers()))
  parser.add_argument("--out", help="write the figures as JSON here")
  args = parser.parse_args()
  results = []
  for method in args.methods:
    figures = soak(method, steps=args.steps, num_workers=args.workers, chunk=args.chunk)
    results.append(figures)
    print(json.dumps(figures), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=2)
  failed = [r["method"] for r in results if r["problems"]]
  print("FAILED: " + ", ".join(failed) if failed else f"all {len(results)} methods sound")
  raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
  main()
