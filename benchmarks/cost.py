"""Update time per step of every registered method vs dense psum and the floor.

Run: python -m benchmarks.cost [--quick] [--budget SECONDS] [--out FILE]

One process, 8 forced CPU devices; a configuration ``(N, n, d)`` uses the
first ``n`` devices. For each configuration every method's real step
(``jax.shard_map`` of ``tx.update`` on one flat float32 gradient of ``N``
elements per worker, state donated) is compiled, run ``--warmup`` more times
(excluded, so the threshold controllers settle), then timed ``--repeats``
times *interleaved*: repeat ``r`` times every method once before repeat
``r + 1`` starts, so a burst of load from other processes hits all methods
alike. Two baselines are timed the same way:

- ``dense_psum``: ``psum(g) / n`` (read the gradient, all-reduce, write the
  mean);
- ``topk_ef``: a plain Top-k error-feedback update written here (``lax.top_k``
  indices only, all-gather, psum, scatter): the library's ``topk`` also reads
  the ``k``-th magnitude, which makes XLA compile a full sort of ``N``
  instead of its TopK kernel (about 100x slower on CPU);
- ``floor``: the elementwise floor of any error-feedback update: read the
  gradient and the residual, write the new residual and a dense update --
  ``u = (g + m) / 2`` and ``m' = (g + m) / 4`` in one loop (interleaved as
  ``[N, 2]``, so XLA:CPU makes it one pass: 4 N-vectors moved).

Configurations run in priority order until ``--budget`` seconds are spent;
the rest are recorded as skipped. 8 devices share the machine's cores, so
the wall time of a step is about the sum of the devices' work: compare
ratios within one configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

from benchmarks import _common

_common.force_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import P  # noqa: E402

import exdyna_jax  # noqa: E402

AXIS = _common.AXIS
CORE = ("exdyna", "dense", "topk_ef")
# Library methods whose Top-k compiles to a full sort of N (see the report):
# compiled ahead of time, no untimed call, this many timed calls.
SLOW = {"topk": 1, "cltk": 2}


def plan(quick: bool) -> list[dict]:
  """Configurations in priority order: the target one first, with every method."""
  every = [*_common.METHODS, "topk_ef"]
  if quick:
    return [
      {"elements": 1_000_000, "workers": 8, "density": 0.001, "methods": every},
      {"elements": 1_000_000, "workers": 4, "density": 0.01, "methods": list(CORE)},
    ]
  configs = [{"elements": _common.RESNET18, "workers": 8, "density": 0.001, "methods": every}]
  order = [
    (_common.RESNET18, 8, 0.01),
    (_common.RESNET18, 4, 0.001),
    (_common.RESNET18, 2, 0.001),
    (_common.RESNET18, 4, 0.01),
    (_common.RESNET18, 2, 0.01),
    (1_000_000, 8, 0.001),
    (1_000_000, 8, 0.01),
    (1_000_000, 4, 0.001),
    (1_000_000, 4, 0.01),
    (1_000_000, 2, 0.001),
    (1_000_000, 2, 0.01),
    (_common.LSTM, 8, 0.001),
    (_common.LSTM, 8, 0.01),
    (_common.LSTM, 4, 0.001),
    (_common.LSTM, 2, 0.001),
    (_common.LSTM, 4, 0.01),
    (_common.LSTM, 2, 0.01),
  ]
  configs += [
    {
      "elements": e,
      "workers": n,
      "density": d,
      "methods": [*CORE, "topk"] if e <= 1_000_000 else list(CORE),
    }
    for e, n, d in order
  ]
  return configs


def _baselines(mesh, num_workers, k):
  """Jitted ``dense_psum``, ``floor`` and ``topk_ef`` programs on ``mesh``."""

  def psum(g):
    return jax.lax.psum(g, AXIS) / num_workers

  def floor(g, m):
    # One fused loop reads g and m once and writes both outputs, interleaved
    # as [N, 2]: 4 passes over N. (Two separate outputs compile, on XLA:CPU,
    # to two loops that each re-read g and m plus a copy: 8 passes.)
    a = g + m
    return jnp.stack([a * 0.5, a * 0.25], axis=-1)

  def topk_ef(g, m):
    a = g + m
    _, indices = jax.lax.top_k(jnp.abs(a), k)
    gathered = jax.lax.all_gather(indices, AXIS).reshape(-1)
    values = jax.lax.psum(a[gathered], AXIS) / num_workers
    return jnp.zeros_like(a).at[gathered].set(values), a.at[gathered].set(0.0)

  psum_fn = jax.jit(jax.shard_map(psum, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  floor_fn = jax.jit(jax.shard_map(floor, mesh=mesh, in_specs=(P(AXIS),) * 2, out_specs=P(AXIS)))
  topk_fn = jax.jit(
    jax.shard_map(topk_ef, mesh=mesh, in_specs=(P(AXIS),) * 2, out_specs=(P(AXIS),) * 2),
    donate_argnums=(1,),
  )
  return psum_fn, floor_fn, topk_fn


@contextlib.contextmanager
def _patched(patch: str | None):
  """Library functions swapped while a variant is traced (profiling only).

  ``no_guard``: no non-finite check (``screen`` finds nothing,
  ``skip_if_nonfinite`` passes the step through). ``kth_min``: Top-k reads
  its ``k``-th magnitude as the minimum of the ``k`` selected ones, which
  keeps XLA's TopK kernel. Library files are not modified.
  """
  from exdyna_jax.selection import _selection
  from exdyna_jax.shell import _guard

  saved = {}
  if patch == "no_guard":

    def no_skip(screened, step, args, *unused_args, **unused_kwargs):
      output, state = step(*args)
      return output, state._replace(stats=state.stats._replace(nonfinite=screened.nonfinite))

    def no_screen(values, stats, num_workers, axis_name, **unused_kwargs):
      # An opaque zero: a constant would let XLA fold the step's select away.
      zero = jax.lax.axis_index(axis_name) * 0
      return _guard.Screen(zero, zero > 0, zero, zero, zero)

    saved = {
      (_guard, "screen"): no_screen,
      (_guard, "skip_if_nonfinite"): no_skip,
    }
  elif patch == "kth_min":

    def select_top_k(accumulated, k):
      magnitudes, indices = jax.lax.top_k(jnp.abs(accumulated), k)
      return indices.astype(jnp.int32), jnp.min(magnitudes)

    saved = {(_selection, "select_top_k"): select_top_k}
  elif patch is not None:
    raise ValueError(f"unknown patch {patch!r}")
  originals = {key: getattr(*key) for key in saved}
  try:
    for (module, attr), fn in saved.items():
      setattr(module, attr, fn)
    yield
  finally:
    for (module, attr), fn in originals.items():
      setattr(module, attr, fn)


class Runner:
  """One timed program with its own carried state (donated every call)."""

  def __init__(self, name, call, carry):
    self.name = name
    self.call = call  # carry -> (outputs, carry)
    self.carry = carry
    self.times: list[float] = []

  def run(self, timed: bool) -> None:
    start = time.perf_counter()
    outputs, self.carry = self.call(self.carry)
    jax.block_until_ready((outputs, self.carry))
    if timed:
      self.times.append(time.perf_counter() - start)
    del outputs


def measure(config: dict, repeats: int, warmup: int) -> dict:
  """Times every method of one configuration, interleaved."""
  n, num_elements, density = config["workers"], config["elements"], config["density"]
  mesh = _common.mesh_of(n)
  sharded = jax.NamedSharding(mesh, P(AXIS))
  replicated = jax.NamedSharding(mesh, P())
  grads = jax.jit(
    lambda key: jax.random.normal(key, (n * num_elements,), jnp.float32) * 0.01,
    out_shardings=sharded,
  )(jax.random.key(0))
  params = jax.device_put(jnp.zeros((num_elements,), jnp.float32), replicated)
  k = int(density * num_elements)
  psum_fn, floor_fn, topk_fn = _baselines(mesh, n, k)
  zeros = jax.jit(lambda: jnp.zeros((n * num_elements,), jnp.float32), out_shardings=sharded)
  runners = [
    Runner("dense_psum", lambda c: (psum_fn(grads), c), None),
    Runner("floor", lambda m: (floor_fn(grads, m), m), zeros()),
  ]
  compile_seconds = {}
  for name in config["methods"]:
    if name == "topk_ef":
      runners.append(Runner(name, lambda m: topk_fn(grads, m), zeros()))
      continue
    method, _, option = name.partition(":")  # e.g. "exdyna:controller=reference"
    extra, patch = {}, None
    if option:
      key, _, value = option.partition("=")
      if key == "patch":
        patch = value
      else:
        extra[key] = {"True": True, "False": False}.get(
            value, float(value) if key == "capacity_factor" else value)
    init_fn, step_fn, _ = _common.method_step(method, density, n, num_elements, **extra)
    state = init_fn(params)
    if name in SLOW or patch:
      start = time.perf_counter()
      with _patched(patch):
        step_fn = step_fn.lower(grads, state, params).compile()
      compile_seconds[name] = time.perf_counter() - start

    def call(state, step_fn=step_fn):
      state, updates = step_fn(grads, state, params)
      return updates, state

    runners.append(Runner(name, call, state))
  for runner in runners:
    if runner.name in SLOW:
      continue
    start = time.perf_counter()
    runner.run(timed=False)  # compiles
    compile_seconds[runner.name] = time.perf_counter() - start
    for _ in range(warmup):
      runner.run(timed=False)
  for r in range(repeats):
    for runner in runners:
      if r < SLOW.get(runner.name, repeats):
        runner.run(timed=True)
  result = {
    **{key: config[key] for key in ("elements", "workers", "density")},
    "k": k,
    "repeats": repeats,
    "warmup_steps": warmup,
    "median_seconds": {r.name: statistics.median(r.times) for r in runners},
    "min_seconds": {r.name: min(r.times) for r in runners},
    "all_seconds": {r.name: r.times for r in runners},
    "first_call_seconds": compile_seconds,
    "stats": {},
  }
  for runner in runners:
    if runner.name in ("dense_psum", "floor", "topk_ef"):
      continue
    stats = jax.tree.map(lambda x: np.asarray(x)[0], exdyna_jax.get_stats(runner.carry))
    result["stats"][runner.name] = {
      "selected_over_k": float(stats.selected) / k,
      "transmitted_over_k": float(stats.transmitted) / k,
      "overflow": int(stats.overflow),
      "imbalance": float(stats.imbalance),
      "bytes_sent": int(stats.bytes_sent),
    }
  med = result["median_seconds"]
  result["ratios"] = {
    name: {
      "over_dense_psum": med[name] / med["dense_psum"],
      "over_floor": med[name] / med["floor"],
    }
    for name in med
  }
  for name in ("topk", "topk_ef"):
    if name in med and "exdyna" in med:
      result["ratios"][f"{name}_over_exdyna"] = med[name] / med["exdyna"]
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="two small configurations")
  parser.add_argument("--budget", type=float, default=780.0, help="seconds for the grid")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--out", default=str(_common.RESULTS / "cost.json"))
  args = parser.parse_args()
  clock = _common.Clock()
  measured, skipped = [], []
  for i, config in enumerate(plan(args.quick)):
    if i > 0 and clock() > args.budget:
      skipped.append(config)
      continue
    repeats = args.repeats if i == 0 else max(3, args.repeats - 2)
    _common.log(f"[cost {clock():6.0f}s] {config}")
    result = measure(config, repeats, args.warmup)
    result["wall_seconds"] = clock()
    measured.append(result)
    med = result["median_seconds"]
    _common.log("   " + ", ".join(f"{k}={v * 1e3:.0f}ms" for k, v in med.items()))
  _common.write_json(
    args.out,
    {
      "benchmark": "cost",
      "budget_seconds": args.budget,
      "total_seconds": clock(),
      "measured": measured,
      "skipped": skipped,
    },
  )


if __name__ == "__main__":
  sys.exit(main())
