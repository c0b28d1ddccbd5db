"""One process of the cluster demo: trains each method for the same seconds.

Started by `exdyna_jax.demo.cluster` through ``exdyna_jax.launch`` (each
process behind its own shaped link)::

  python -m exdyna_jax.demo.cluster_worker --task digits-wide \\
      --variants dense,exdyna --config '{"steps": 300, "density": 0.01}'

Every process trains the task's model with the donated
``data_parallel(tx, mesh).step`` a user runs, one variant after the other.
``dense`` trains ``config.steps`` steps and its time (evaluation excluded)
is every other variant's budget, so the scores compare at equal seconds;
each plans its learning-rate schedule over the steps that fit it. A
variant ``<method>_warmup`` starts with a DGC density warm-up
(``config.density_warmup`` steps per level, 25 by default). Process 0 prints
one JSON line per variant (its curve of ``(seconds, step, test_accuracy,
transmitted)`` points, taken every ``config.eval_every`` steps) and a
progress line per evaluation on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

import exdyna_jax
from exdyna_jax import launch
from exdyna_jax.demo import tasks
from exdyna_jax.demo.recipes import (
    AXIS,
    TrainConfig,
    optimizer_for,
    warmup_steps,
    with_measured_network,
)
from exdyna_jax.demo.trainer import Task, make_mesh

DEFAULT_DENSITY_WARMUP = 25


def put(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array of ``value`` (the same on every process) laid out as ``sharding``."""
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_value(x: jax.Array):
  """The first element of this process's first shard of ``x`` (a per-worker stat, say)."""
  return np.asarray(x.addressable_shards[0].data).reshape(-1)[0]


def barrier(value: float = 0.0) -> float:
  """Waits for every process; returns the largest ``value`` of any process."""
  return float(np.max(multihost_utils.process_allgather(np.float32(value))))


def variant_config(variant: str, config: TrainConfig) -> tuple[str, TrainConfig]:
  """The method of ``variant`` and its config: ``*_warmup`` adds a density warm-up."""
  method = variant.removesuffix("_warmup")
  if method == variant:
    return method, config
  return method, dataclasses.replace(
      config, density_warmup=config.density_warmup or DEFAULT_DENSITY_WARMUP)


PROBE_STEPS = 3
"""Steps timed (on copies, off the clock) to plan how many fit a variant's budget."""


def compiled_step(method: str, task: Task, config: TrainConfig, mesh: jax.sharding.Mesh,
                  params: Any, probe_batches: Callable[[], Any]):
  """``(dp, train_step, step_seconds)``: ``method``'s donated step, compiled, and timed.

  Off the clock, on copies of ``params`` and a fresh state, thrown away: the
  step runs through ``method``'s density warm-up (`recipes.warmup_steps`;
  the first run compiles it), then `PROBE_STEPS` times more; ``step_seconds``
  is the median of those, what most of the run's steps take.
  """
  tx = optimizer_for(method, config, mesh.size)
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=AXIS)

  @dp.step
  def train_step(params, opt_state, batch):
    grads = jax.grad(task.loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  copies = (jax.tree.map(jnp.copy, params), dp.init(params))
  first_timed = max(warmup_steps(method, config, mesh.size), 1)
  seconds = []
  for _ in range(first_timed + PROBE_STEPS):
    start = time.perf_counter()
    copies = jax.block_until_ready(train_step(*copies, probe_batches()))
    seconds.append(time.perf_counter() - start)
  return dp, train_step, float(np.median(seconds[first_timed:]))


def train_timed(variant: str, task: Task, config: TrainConfig, mesh: jax.sharding.Mesh, *,
                budget: float | None) -> dict:
  """Trains ``config.steps`` steps (``budget`` None) or ``budget`` seconds; its curve.

  Under a budget the learning-rate schedule spans the steps that fit it, as
  a user given those seconds would set it: ``budget`` over the seconds of a
  step after the density warm-up (at least ``config.steps``).
  """
  method, config = variant_config(variant, config)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  sharded = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  initial = jax.tree.map(np.asarray, task.init_params(jax.random.key(config.seed)))
  params = jax.tree.map(lambda v: put(v, replicated), initial)

  def batch(rng):
    inputs, targets = task.sample_batch(rng, config.batch_per_worker * jax.device_count())
    return put(inputs, sharded), put(targets.astype(np.int32), sharded)

  probe_rng = np.random.default_rng(config.seed + 1)
  dp, train_step, probe_seconds = compiled_step(method, task, config, mesh, params,
                                                lambda: batch(probe_rng))
  # The slowest process's time: every process plans the same schedule.
  if budget is not None and (planned := int(budget / barrier(probe_seconds))) > config.steps:
    config = dataclasses.replace(config, steps=planned)
    dp, train_step, _ = compiled_step(method, task, config, mesh, params,
                                      lambda: batch(probe_rng))
  opt_state = dp.init(params)
  evaluate = jax.jit(task.evaluate)
  metric = next(iter(evaluate(params)))  # the task's headline: test accuracy, test loss
  rng = np.random.default_rng(config.seed)  # the same batches on every process and variant
  curve, step_seconds, seconds, step, done = [], [], 0.0, 0, False
  while not done:
    next_batch = batch(rng)
    start = time.perf_counter()
    params, opt_state = jax.block_until_ready(train_step(params, opt_state, next_batch))
    step_seconds.append(time.perf_counter() - start)
    seconds += step_seconds[-1]
    step += 1
    last = budget is None and step == config.steps
    if step % config.eval_every == 0 or last:  # every process alike: on the slowest one's clock
      seconds = barrier(seconds)
      score = float(evaluate(params)[metric])
      transmitted = int(local_value(dp.stats(opt_state).transmitted))
      curve.append((round(seconds, 4), step, score, transmitted))
      done = step >= config.steps if budget is None else seconds >= budget
      if jax.process_index() == 0:
        print(f"{variant}: step {step}, {seconds:.1f} s, {metric} {score:.4f}",
              file=sys.stderr, flush=True)
  # The stats are the same on every worker: this process's copy of them, whole.
  totals = exdyna_jax.read_totals(jax.tree.map(
      lambda x: np.asarray(x.addressable_shards[0].data), dp.stats(opt_state)))
  return {"variant": variant, "curve": curve, "steps": step, "seconds": seconds,
          "planned_steps": config.steps, "metric": metric,
          "higher_is_better": task.higher_is_better,
          "median_step_ms": round(1e3 * float(np.median(step_seconds)), 2),
          "num_elements": sum(v.size for v in jax.tree.leaves(initial)),
          "bytes_sent": totals["bytes_sent"] // step}


def main(argv: list[str] | None = None) -> None:
  """Trains every ``--variants`` in turn; process 0 prints a JSON line for each."""
  launch.initialize_from_env()  # before JAX computes anything
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--task", default="digits-wide", choices=sorted(tasks.TASKS))
  parser.add_argument("--variants", default="dense,exdyna")
  parser.add_argument("--config", default="{}", help="TrainConfig fields as JSON")
  args = parser.parse_args(argv)
  config = TrainConfig(**json.loads(args.config))
  variants = args.variants.split(",")
  if variants[0] != "dense":
    raise SystemExit("dense comes first: its time is every other variant's budget")
  task, mesh = tasks.TASKS[args.task](), make_mesh(jax.device_count())
  config = with_measured_network(config, mesh)
  budget = None
  for variant in variants:
    result = train_timed(variant, task, config, mesh, budget=budget)
    budget = result["seconds"] if budget is None else budget
    if jax.process_index() == 0:
      print(json.dumps({**result, "processes": jax.process_count(),
                        "density": config.density, "network": config.network}), flush=True)


if __name__ == "__main__":
  main()
