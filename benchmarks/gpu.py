"""The per-worker update step on one accelerator: ExDyna against the floor and Top-k.

Eight workers are simulated with ``jax.vmap(axis_name="data", axis_size=8)``
on the one device (so every worker's partition is an eighth of ``N``, as on
8 GPUs); the collectives become local copies. Every time reported is the
whole 8-worker step divided by 8: one worker's share. Each step is the one a
user runs: jitted, the state donated and returned first.

Methods (all on the same gradients):

==================  ==========================================================
exdyna              ``exdyna(d)``, the default (balanced, adaptive)
exdyna_loops        ``exdyna(d)`` with the passes over the partition as XLA
                    loops (`_range_kernels.KERNEL_PLATFORMS` emptied), as before
                    the Pallas kernels: the same results, another program
exdyna_unguarded    a diagnostic, not a method to use: ``exdyna(d)`` with the
                    guard patched out (a sum over the gradient and its
                    ``psum`` stay; no conditional, no select), to measure
                    what the guard's conditionals cost
exdyna_unchecked    a diagnostic: ``exdyna(d)`` with the check of a state that
                    does not fit patched out (its conditional, which the host
                    waits on mid-step, and its host callback), to measure what
                    that check costs
exdyna_reference    ``exdyna(d, controller="reference")``
micro               ``micro(d)``
topk_union          ``topk(d / 8, exact=False)``: each worker its own ``d / 8``
                    largest (about ``d`` in all), the AdamW recipe's sparsifier
chunked_topk        ``chunked_topk(d, value_bits=2)``: the compact wire (12-bit
                    offsets, 2-bit values), as local steps send it
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

``--gpt`` times the train step of a GPT-like transformer (`GPT`: 12 layers,
width 768, 85.3M parameters, causal attention in bfloat16, a byte vocabulary),
8 workers under ``vmap`` with `GPT_BATCH` sequences of 256 tokens each,
``optax.chain(method, optax.adamw)``: ``compute`` (AdamW alone, the updates
averaged on the one device), ``dense``, ``exdyna`` and the AdamW recipe
``topk_union`` (``sparse_adamw(topk(d / 8, exact=False))``) at d = 0.001 and
0.01 (`_gpu_train.GPT_METHODS`; ``--gpt-methods exdyna@0.001,...`` picks
some, ``compute`` always first).

``--check`` compares the Pallas kernels with the loops on this device
(``kernels_against_loops``): the two passes on one worker's gradient, and
ExDyna, its reference rule and MiCRO for a few steps (`_gpu_check`).

``--against-cpu`` runs every registered method (and ExDyna's reference
rule) for a few steps of 8 workers on this device and on the CPU, on the
same gradients of a few leaves, and compares them (`_gpu_against_cpu`).

``--compare-xla-flags='|--xla_gpu_enable_command_buffer='`` times the target
row instead under each ``XLA_FLAGS`` setting between the bars (empty: XLA's
defaults), in turn ``--rounds`` times (`_gpu_flags`; ``results/gpu_flags.json``).

``--chunk-scales 1,2,4`` also times ``exdyna`` at the target with the
partition read in chunks that many times `_selection.chunk_length` (fewer
loop iterations, more elements read past the partition's ends).

``--profile DIR`` traces a few steps of ``--profile-methods`` (default:
ExDyna) at the target size with ``jax.profiler``, queued (into
``DIR/<method>``) and blocked on each (``DIR/<method>_blocked``: the host's
launches then show beside the device's idle time), and records, per device
thread of the trace, the busiest operations per step (``profile`` in the
JSON), and the number of kernels a step launches; with ``--gpt``, also the
GPT's train step of `GPT_PROFILED` (``gpt.profile`` in the JSON).

Every method is timed blocked on each step (``seconds``: what a loop that
reads each step's result gets, the host's dispatch and wait included),
queued (``queued_seconds``: the device's throughput where the host runs
ahead) and to the call's return (``dispatch_seconds``: the host's launches,
and its wait for whatever the program reads back mid-step).
``exdyna_over_floor`` is the blocked ExDyna step over 16 N bytes at the copy
bandwidth (queued ``y = x + 1``), ``exdyna_over_floor_program`` over the
floor program, blocked too.

Writes ``results/gpu.json`` (``device``, ``exdyna_over_floor`` and
``topk_over_exdyna`` at N = 25M, d = 0.001, and the full table) unless
``--out`` says otherwise. ``--quick`` runs small sizes (for CPU and tests),
``--target-only`` the target alone (to compare ``XLA_FLAGS``, say).

Run: python -m benchmarks.gpu [--quick] [--target-only] [--train] [--gpt] [--check]
     [--against-cpu] [--profile DIR]
     [--out FILE] [--repeats 20] [--methods a,b,...]
     python -m benchmarks.gpu --compare-xla-flags='F|F...' [--rounds 2] [--methods a,b,...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp

import exdyna_jax
from benchmarks import _common, _gpu_against_cpu, _gpu_check, _gpu_flags, _gpu_train
from benchmarks._gpu_profile import traced_steps
from benchmarks._gpu_programs import vmapped_update
from benchmarks._gpu_timing import WORKERS, timed_steps, timing, traced_as
from exdyna_jax.selection import _selection

TARGET = {"elements": 25_000_000, "density": 0.001}
FULL_GRID = [(n, d) for n in (11_200_000, 25_000_000, 100_000_000) for d in (0.01, 0.001)]
QUICK_GRID = [(200_000, 0.001)]
METHODS = ("exdyna", "exdyna_loops", "exdyna_unguarded", "exdyna_unchecked", "exdyna_reference",
           "micro", "topk_union", "chunked_topk", "topk_ef", "floor")
GPT_PROFILED = ("exdyna@0.001", "topk_union@0.01")


def time_method(name, num_elements, density, grads, repeats):
  with traced_as(name):  # the step is traced at its first call
    state, run = vmapped_update(name, num_elements, density)
    (state, _), times, queued, returned = timed_steps(
        lambda carry: run(carry[0], grads), (state, None), repeats)
  result = timing(times, queued, per=WORKERS, returned=returned)
  if name not in ("floor", "topk_ef"):
    stats = exdyna_jax.get_stats(state)
    k = int(density * num_elements)
    result["sent_over_k"] = float(stats.transmitted[0]) / k
  return result


def copy_bandwidth(num_elements, repeats):
  """Bytes per second of ``y = x + 1`` over ``8 N`` float32 (read and write), queued:
  the device's rate, without the host's dispatch and wait of a blocked step."""
  bump = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  _, _, queued, _ = timed_steps(bump, jnp.ones((WORKERS * num_elements,), jnp.float32), repeats)
  return 8 * WORKERS * num_elements / queued


def profile_methods(trace_root, num_elements, density, grads, methods):
  """`traced_steps` of each method, queued into ``trace_root/<method>`` and
  blocked on each step into ``trace_root/<method>_blocked``."""
  profiles = {}
  for name in methods:
    with traced_as(name):
      state, run = vmapped_update(name, num_elements, density)
      state = jax.block_until_ready(run(state, grads))[0]  # compiled
      for blocked in (False, True):
        label = f"{name}_blocked" if blocked else name
        fresh = jax.tree.map(jnp.copy, state)  # the trace donates what it is given
        profiles[label] = traced_steps(pathlib.Path(trace_root) / label, run, fresh, grads,
                                       next_carry=lambda out: out[0], blocked=blocked)
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


def gpt_methods(names):
  """``(name, density)`` pairs of ``--gpt-methods`` (``exdyna@0.001,dense``)."""
  if names is None:
    return _gpu_train.GPT_METHODS
  pairs = [name.partition("@") for name in names.split(",")]
  return [(name, float(density) if density else None) for name, _, density in pairs]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, for CPU and tests")
  parser.add_argument("--target-only", action="store_true", help="the target size alone")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--out", default=None, help="JSON (default: results/gpu.json)")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="comma-separated subset (exdyna, topk_ef and floor give the ratios)")
  parser.add_argument("--train", action="store_true", help="also time the whole train step")
  parser.add_argument("--gpt", action="store_true",
                      help="also time the train step of a GPT-like transformer")
  parser.add_argument("--gpt-methods", default=None, metavar="M@D,...",
                      help="the GPT's methods (default: all; compute always runs first)")
  parser.add_argument("--check", action="store_true",
                      help="also check that the kernels and the loops give the same run")
  parser.add_argument("--against-cpu", action="store_true",
                      help="also compare every method's run here with the CPU's")
  parser.add_argument("--chunk-scales", default=None, metavar="S,S,...",
                      help="also time exdyna at these multiples of the chunk length")
  parser.add_argument("--compare-xla-flags", default=None, metavar="'F|F...'",
                      help="time the target row under each XLA_FLAGS setting instead")
  parser.add_argument("--rounds", type=int, default=2,
                      help="how many times each --compare-xla-flags setting runs")
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="also trace methods at the target size into DIR")
  parser.add_argument("--profile-methods", default="exdyna",
                      help="comma-separated methods to trace (default: exdyna)")
  args = parser.parse_args(argv)
  methods = args.methods.split(",")
  unknown = set(methods) - set(METHODS) or {"exdyna", "topk_ef", "floor"} - set(methods)
  if unknown:
    parser.error(f"--methods: {sorted(unknown)} unknown or missing; choose from {METHODS}, "
                 "with exdyna, topk_ef and floor")
  if args.compare_xla_flags is not None:
    return _gpu_flags.compare(args.compare_xla_flags.split("|"), methods, args.rounds,
                              ["--repeats", str(args.repeats), *(["--quick"] * args.quick)],
                              out=args.out and pathlib.Path(args.out))
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
  def save():  # after every part: a run cut short keeps what it measured
    out.write_text(json.dumps(result, indent=1) + "\n")

  for number, (num_elements, density) in enumerate(grid):
    row, grads = grid_row(num_elements, density, methods, args.repeats)
    result["rows"].append(row)
    if number == 0:
      result.update(at={"elements": num_elements, "density": density},
                    exdyna_over_floor=row["exdyna_over_floor"],
                    topk_over_exdyna=row["topk_over_exdyna"])
    save()
    if number == 0:
      if args.against_cpu:
        result["against_cpu"] = _gpu_against_cpu.against_cpu(density)
        save()
      if args.check:
        result["kernels_against_loops"] = _gpu_check.check_kernels(num_elements, density, grads)
        save()
      if args.chunk_scales:
        result["chunk_scales"] = chunk_rows(
            num_elements, density, grads, [int(x) for x in args.chunk_scales.split(",")],
            args.repeats)
        save()
      if args.train:
        result["train"] = _gpu_train.train_rows(
            _gpu_train.QUICK_TRAIN_LAYERS if args.quick else _gpu_train.TRAIN_LAYERS, density,
            args.repeats)
        save()
      if args.gpt:
        result["gpt"] = {}
        _gpu_train.gpt_rows(_gpu_train.QUICK_GPT if args.quick else _gpu_train.GPT,
                            args.repeats, result["gpt"], save=save, profile=args.profile,
                            profiled=GPT_PROFILED, methods=gpt_methods(args.gpt_methods))
      if args.profile:
        result["profile"] = profile_methods(
            args.profile, num_elements, density, grads, args.profile_methods.split(","))
        save()
    del grads
  print(json.dumps({k: result[k] for k in ("device", "exdyna_over_floor", "topk_over_exdyna")}))
  return result


if __name__ == "__main__":
  main()
