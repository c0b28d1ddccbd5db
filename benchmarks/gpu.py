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

``--train`` also times the whole train step a user runs: an MLP of
``TRAIN_LAYERS`` (25.2M parameters, 16 classes; ``--quick``: a small one), 8 workers
under ``vmap`` with ``TRAIN_BATCH`` examples each, ``optax.chain(method,
optax.sgd)``, jitted with params and state donated: ``compute`` (the
gradients and SGD, no exchange), ``dense``, ``exdyna`` and ``topk``.

``--chunk-scales 1,2,4`` also times ``exdyna`` at the target with the
partition read in chunks that many times `_selection.chunk_length` (fewer
loop iterations, more elements read past the partition's ends).

``--profile DIR`` traces a few steps of each method at the target size with
``jax.profiler`` (the trace lands in ``DIR``) and records, per device
thread of the trace, the busiest operations per step (``profile`` in the
JSON), and the number of kernels a step launches.

Every method is timed blocked on each step (``seconds``: what a loop that
reads each step's result gets, the host's dispatch and wait included) and
queued (``queued_seconds``: the device's throughput where the host runs
ahead). ``exdyna_over_floor`` is the blocked ExDyna step over 16 N bytes at
the copy bandwidth (queued ``y = x + 1``), ``exdyna_over_floor_program`` over
the floor program, blocked too.

Writes ``results/gpu.json`` (``device``, ``exdyna_over_floor`` and
``topk_over_exdyna`` at N = 25M, d = 0.001, and the full table) unless
``--out`` says otherwise. ``--quick`` runs small sizes (for CPU and tests),
``--target-only`` the target alone (to compare ``XLA_FLAGS``, say).

Run: python -m benchmarks.gpu [--quick] [--target-only] [--train] [--profile DIR]
     [--out FILE] [--repeats 20] [--methods a,b,...]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import optax

import exdyna_jax
from benchmarks import _common
from benchmarks._gpu_profile import busiest_operations, with_sources
from exdyna_jax.demo import tasks
from exdyna_jax.selection import _selection

AXIS = "data"
WORKERS = 8
TARGET = {"elements": 25_000_000, "density": 0.001}
FULL_GRID = [(n, d) for n in (11_200_000, 25_000_000, 100_000_000) for d in (0.01, 0.001)]
QUICK_GRID = [(200_000, 0.001)]
METHODS = ("exdyna", "exdyna_reference", "micro", "topk_ef", "floor")
# 25.2M parameters, a multiple of 4: under vmap the 8 workers' residuals are
# the rows of one [8, N] array, and where N is not (10 classes: N % 4 == 2)
# rows 1-7 start off the 16-byte alignment XLA:GPU vectorises by (on an
# H200 the accumulation of this tree took 1.12 ms with 10 classes, 0.58 ms
# with N a multiple of 4). On 8 GPUs each residual is a buffer of its own.
TRAIN_LAYERS = (2048, 4096, 4096, 16)
QUICK_TRAIN_LAYERS = (64, 256, 256, 10)
TRAIN_BATCH = 128  # examples per worker
TRAIN_METHODS = ("compute", "dense", "exdyna", "topk")
PROFILE_STEPS = 5


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
      # New residual and dense update; two different values, two buffers
      # written (equal ones would be computed once and copied: 20 N bytes).
      return accumulated * 0.5, accumulated * 0.25
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


def timed_steps(step, carry, repeats):
  """Runs ``carry = step(carry)`` 3 times to compile and warm up, then ``repeats``
  times blocked on each, then ``repeats`` times queued (one block at the end).

  Returns:
    ``(carry, times, queued)``: the last carry, the seconds of each blocked
    step (what a loop that reads every step's result gets: the host's
    dispatch and the wait included) and the mean seconds of a queued one
    (the device's throughput, where the host can run ahead).
  """
  for _ in range(3):
    carry = step(carry)
  carry, times = _common.blocked_seconds(step, jax.block_until_ready(carry), repeats)
  start = time.perf_counter()
  for _ in range(repeats):
    carry = step(carry)
  carry = jax.block_until_ready(carry)
  return carry, times, (time.perf_counter() - start) / repeats


def timing(times, queued, per=1):
  """The JSON of `timed_steps`' times, each divided by ``per``."""
  return {"seconds": statistics.median(times) / per, "min_seconds": min(times) / per,
          "queued_seconds": queued / per}


def vmapped_update(name, num_elements, density):
  """``(state, run)``: the 8 workers' state and the jitted step ``run(state, grads)``."""
  init, step = program(name, num_elements, density)
  run = jax.jit(jax.vmap(step, axis_name=AXIS, axis_size=WORKERS), donate_argnums=0)
  state = jax.jit(jax.vmap(lambda _: init(), axis_name=AXIS, axis_size=WORKERS))(
      jnp.arange(WORKERS)
  )
  return state, run


def time_method(name, num_elements, density, grads, repeats):
  state, run = vmapped_update(name, num_elements, density)
  (state, _), times, queued = timed_steps(
      lambda carry: run(carry[0], grads), (state, None), repeats)
  result = timing(times, queued, per=WORKERS)
  if name not in ("floor", "topk_ef"):
    stats = exdyna_jax.get_stats(state)
    k = int(density * num_elements)
    result["sent_over_k"] = float(stats.transmitted[0]) / k
  return result


def copy_bandwidth(num_elements, repeats):
  """Bytes per second of ``y = x + 1`` over ``8 N`` float32 (read and write), queued:
  the device's rate, without the host's dispatch and wait of a blocked step."""
  bump = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  _, _, queued = timed_steps(bump, jnp.ones((WORKERS * num_elements,), jnp.float32), repeats)
  return 8 * WORKERS * num_elements / queued


def train_step(name, layers, density):
  """``(init, step)``: the 8 workers' jitted ``init(params)`` and train step.

  ``step((params, opt_state), batch)`` donates and returns both. Every
  worker computes its gradient on its share of the batch; ``compute`` has
  no exchange (the workers' SGD updates are averaged on the one device,
  which is not a collective), the others chain the method with SGD.
  """
  tx = optax.sgd(0.01)
  if name != "compute":
    tx = optax.chain(_common.make_tx(name, density, WORKERS), tx)

  def per_worker(params, opt_state, batch):
    grads = jax.grad(tasks.mlp_loss)(params, batch)
    return tx.update(grads, opt_state, params)

  workers = jax.vmap(per_worker, in_axes=(None, 0, 0), axis_name=AXIS, axis_size=WORKERS)

  def step(carry, batch):
    params, opt_state = carry
    updates, opt_state = workers(params, opt_state, batch)
    # Identical on every worker after the exchange; compute's are averaged here.
    updates = jax.tree.map(lambda u: jnp.mean(u, axis=0), updates)
    return optax.apply_updates(params, updates), opt_state

  init = jax.vmap(lambda params, _: tx.init(params), in_axes=(None, 0), axis_name=AXIS)
  return jax.jit(lambda params: init(params, jnp.arange(WORKERS))), jax.jit(
      step, donate_argnums=0)


def train_rows(layers, density, repeats):
  """Median seconds of the whole 8-worker train step, per `TRAIN_METHODS`."""
  params = tasks.init_mlp(jax.random.key(0), layers)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  key_x, key_y = jax.random.split(jax.random.key(1))
  batch = (jax.random.normal(key_x, (WORKERS, TRAIN_BATCH, layers[0])),
           jax.random.randint(key_y, (WORKERS, TRAIN_BATCH), 0, layers[-1]))
  rows = {"parameters": num_params, "layers": list(layers), "workers": WORKERS,
          "batch_per_worker": TRAIN_BATCH, "density": density}
  for name in TRAIN_METHODS:
    init, step = train_step(name, layers, density)
    carry = (jax.tree.map(jnp.copy, params), init(params))
    _, times, queued = timed_steps(functools.partial(step, batch=batch), carry, repeats)
    rows[name] = timing(times, queued)
    print(f"train {num_params:,} params {name}: {1e3 * rows[name]['seconds']:.3f} ms",
          file=sys.stderr, flush=True)
  for name in TRAIN_METHODS[1:]:
    rows[f"{name}_over_compute"] = rows[name]["seconds"] / rows["compute"]["seconds"]
  return rows


def profile_methods(trace_root, num_elements, density, grads, methods):
  """Traces `PROFILE_STEPS` steps of each method; returns `busiest_operations`
  and the optimised HLO of each step under ``trace_root/<method>``."""
  profiles = {}
  for name in methods:
    state, run = vmapped_update(name, num_elements, density)
    state = jax.block_until_ready(run(state, grads))[0]  # compiled
    directory = pathlib.Path(trace_root) / name
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
      for _ in range(PROFILE_STEPS):
        state, _ = run(state, grads)
      state = jax.block_until_ready(state)
    hlo = run.lower(state, grads).compile().as_text()
    (directory / "step.hlo.txt").write_text(hlo)
    profiles[name] = with_sources(busiest_operations(directory, PROFILE_STEPS), hlo)
  return profiles


def chunk_rows(num_elements, density, grads, scales, repeats):
  """``exdyna`` at chunks of ``scale`` times `_selection.chunk_length`, per scale."""
  rows = {}
  default = _selection.chunk_length
  for scale in scales:
    def scaled(*args, scale=scale):
      return min(args[0], scale * default(*args))
    with mock.patch.object(_selection, "chunk_length", scaled):
      rows[scale] = time_method("exdyna", num_elements, density, grads, repeats)
    rows[scale]["chunk"] = scaled(num_elements, WORKERS)
    print(f"chunk x{scale}: {1e3 * rows[scale]['seconds']:.3f} ms", file=sys.stderr, flush=True)
  return rows


def grid_row(num_elements, density, methods, repeats):
  """One row of the table: every method on the same gradients, and the ratios."""
  grads = jax.random.normal(jax.random.key(0), (WORKERS, num_elements), jnp.float32)
  bandwidth = copy_bandwidth(num_elements, repeats)
  row = {"elements": num_elements, "density": density, "workers": WORKERS,
         "copy_bandwidth_bytes_per_second": bandwidth,
         "floor_bandwidth_seconds": 16 * num_elements / bandwidth}
  for name in methods:
    row[name] = time_method(name, num_elements, density, grads, repeats)
    print(f"N={num_elements:,} d={density} {name}: {1e3 * row[name]['seconds']:.3f} ms",
          file=sys.stderr, flush=True)
  exdyna = row["exdyna"]["seconds"]
  # The floor: 16 N bytes at the measured copy bandwidth.
  row["exdyna_over_floor"] = exdyna / row["floor_bandwidth_seconds"]
  row["exdyna_queued_over_floor"] = row["exdyna"]["queued_seconds"] / row[
      "floor_bandwidth_seconds"]
  row["exdyna_over_floor_program"] = exdyna / row["floor"]["seconds"]
  row["topk_over_exdyna"] = row["topk_ef"]["seconds"] / exdyna
  return row, grads


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, for CPU and tests")
  parser.add_argument("--target-only", action="store_true", help="the target size alone")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--out", default=None, help="JSON (default: results/gpu.json)")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="comma-separated subset (exdyna, topk_ef and floor give the ratios)")
  parser.add_argument("--train", action="store_true", help="also time the whole train step")
  parser.add_argument("--chunk-scales", default=None, metavar="S,S,...",
                      help="also time exdyna at these multiples of the chunk length")
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="also trace each method at the target size into DIR")
  args = parser.parse_args(argv)
  methods = args.methods.split(",")
  unknown = set(methods) - set(METHODS) or {"exdyna", "topk_ef", "floor"} - set(methods)
  if unknown:
    parser.error(f"--methods: {sorted(unknown)} unknown or missing; choose from {METHODS}, "
                 "with exdyna, topk_ef and floor")
  grid = QUICK_GRID if args.quick else FULL_GRID
  target = (TARGET["elements"], TARGET["density"])
  grid = sorted(grid, key=lambda cell: cell != target)  # the target first
  if args.target_only:
    grid = grid[:1]
  device = jax.devices()[0]
  out = pathlib.Path(args.out) if args.out else _common.RESULTS / "gpu.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  result = {
      "benchmark": "gpu",
      "device": device.device_kind,
      "platform": device.platform,
      "jax": jax.__version__,
      "machine": _common.machine_info(),
      "quick": args.quick,
      "timing": "8 workers simulated with jax.vmap on one device; one worker's share "
                "(the whole step / 8); jitted, state donated",
      "rows": [],
  }
  for number, (num_elements, density) in enumerate(grid):
    row, grads = grid_row(num_elements, density, methods, args.repeats)
    result["rows"].append(row)
    if number == 0:
      result.update(at={"elements": num_elements, "density": density},
                    exdyna_over_floor=row["exdyna_over_floor"],
                    topk_over_exdyna=row["topk_over_exdyna"])
      if args.chunk_scales:
        result["chunk_scales"] = chunk_rows(
            num_elements, density, grads, [int(x) for x in args.chunk_scales.split(",")],
            args.repeats)
      if args.profile:
        result["profile"] = profile_methods(args.profile, num_elements, density, grads, methods)
      if args.train:
        result["train"] = train_rows(QUICK_TRAIN_LAYERS if args.quick else TRAIN_LAYERS,
                                     density, args.repeats)
    del grads
    out.write_text(json.dumps(result, indent=1) + "\n")  # after every row: partial results
  print(json.dumps({k: result[k] for k in ("device", "exdyna_over_floor", "topk_over_exdyna")}))
  return result


if __name__ == "__main__":
  main()
