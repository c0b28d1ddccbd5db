"""Trains one model with one gradient exchange method on simulated workers.

Only the public API, as a user writes it: the train step is a per-worker
step decorated with ``data_parallel(tx, mesh).step`` (jitted, the state
donated), every worker differentiates the loss on its own shard of the
batch, the sparsifier exchanges what it selected, and the optimizer that
follows applies the aggregated update, identical on every worker. The
per-worker losses leave the step unreduced, so the only collectives in the
compiled step are the method's own: `exdyna_jax.hlo.bytes_per_worker` of its HLO is
exactly what the method exchanges. The stats (``stats.target`` is the
step's ``k``) are read with ``dp.stats`` after the timed step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

import exdyna_jax
from exdyna_jax import hlo
from exdyna_jax.demo.recipes import AXIS, SHARED_DENSITY, TrainConfig, optimizer_for


class Task(NamedTuple):
  """A model, its data and how to score it.

  Attributes:
    name: short name, e.g. ``"digits"``.
    init_params: ``key -> params`` pytree.
    loss_fn: ``(params, inputs, targets) -> scalar`` mean loss on a batch.
    evaluate: ``params -> {metric: value}`` on held-out data; the first
      metric is the headline one (e.g. ``test_accuracy``).
    sample_batch: ``(rng, global_batch) -> (inputs, targets)`` numpy arrays
      whose leading axis is split across workers.
    higher_is_better: whether the headline metric should go up.
  """

  name: str
  init_params: Callable[[jax.Array], Any]
  loss_fn: Callable[[Any, Any, Any], jax.Array]
  evaluate: Callable[[Any], dict[str, float]]
  sample_batch: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]
  higher_is_better: bool = True


def make_mesh(num_workers: int) -> jax.sharding.Mesh:
  """A 1-D mesh ``("data",)`` over the first ``num_workers`` devices."""
  if jax.device_count() < num_workers:
    raise ValueError(
        f"{num_workers} workers need {num_workers} devices, JAX has {jax.device_count()}. "
        f"Simulate them on CPU: set jax.config.update('jax_num_cpu_devices', {num_workers}) "
        "(or XLA_FLAGS=--xla_force_host_platform_device_count) before JAX starts."
    )
  return jax.make_mesh(
      (num_workers,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
      devices=jax.devices()[:num_workers],
  )


class CompiledMethod(NamedTuple):
  """A method's data-parallel wiring, its train step and what the step exchanges.

  Attributes:
    dp: `exdyna_jax.data_parallel` of the optimizer (``dp.stats``).
    opt_state: ``dp.init(params)``, the state the step was lowered with and
      the run starts from.
    step: ``(params, opt_state, (inputs, targets)) -> (params, opt_state,
      worker_losses [n])``, the ``dp.step`` a user runs (donates the state).
    hlo_bytes: bytes one worker sends per step, counted from the compiled HLO.
    collectives: the collectives of the compiled step.
  """

  dp: exdyna_jax.DataParallel
  opt_state: Any
  step: Callable[..., tuple[Any, Any, jax.Array]]
  hlo_bytes: int
  collectives: list[hlo.Collective]


def compile_method(
    task: Task, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, params: Any,
    example_batch: tuple[np.ndarray, np.ndarray],
) -> CompiledMethod:
  """Builds the ``dp.step`` train step of ``tx`` for ``task`` and counts its collectives.

  Args:
    task: the `Task`.
    tx: the optimizer, sparsifier first.
    mesh: the mesh with axis ``"data"``.
    params: initial parameters.
    example_batch: a global batch (for shapes).

  Returns:
    The `CompiledMethod`.
  """
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=AXIS)

  @dp.step
  def train_step(params, opt_state, batch):  # per worker: its own shard of the batch
    loss, grads = jax.value_and_grad(task.loss_fn)(params, *batch)  # its own gradient
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = dp.init(params)
  lowered = train_step.lower(params, opt_state, example_batch)  # lowering donates nothing
  found = hlo.collectives(lowered.compile().as_text(), mesh.size)
  return CompiledMethod(dp, opt_state, train_step, round(sum(c.bytes_sent for c in found)),
                        found)


@dataclasses.dataclass
class MethodRun:
  """What one method's run produced.

  Attributes:
    method: registry name.
    num_elements: ``N``, gradient elements.
    target: ``k`` elements per step (``N`` for dense; the last level's with a
      density warm-up: each record's ``sent_over_k`` is against its step's).
    records: one dict per step (see `train_method`).
    final_metrics: `Task.evaluate` after the last step.
    hlo_bytes: bytes per worker per step, from the compiled HLO.
    collectives: the compiled step's collectives.
  """

  method: str
  num_elements: int
  target: int
  records: list[dict[str, Any]]
  final_metrics: dict[str, float]
  hlo_bytes: int
  collectives: list[hlo.Collective]


def asked_count(method: str, stats: Any, num_workers: int) -> int:
  """The ``k`` a step asked of all the workers together: `SHARED_DENSITY`'s is their
  workers'."""
  return int(stats.target) * (num_workers if method.lower() in SHARED_DENSITY else 1)


def _record(step, seconds, losses, stats, target, num_elements, exchanged) -> dict[str, Any]:
  """A step's record; where it exchanged nothing (a local step): nothing sent or left over, and
  no sent/k."""
  transmitted = int(stats.transmitted) if exchanged else 0
  return {
      "step": step,
      "loss": float(np.mean(losses)),
      "step_time_s": seconds,
      "threshold": float(stats.threshold),
      "selected": int(stats.selected),
      "transmitted": transmitted,
      "target": target,
      "overflow": int(stats.overflow) if exchanged else 0,
      "density": transmitted / num_elements,
      "sent_over_k": transmitted / target if exchanged else None,
      "imbalance": float(stats.imbalance),
      "bytes_sent": int(stats.bytes_sent) if exchanged else 0,
      "partition_starts": stats.partition_starts.tolist(),
      "partition_sizes": stats.partition_sizes.tolist(),
  }


def train_method(
    method: str, task: Task, config: TrainConfig, mesh: jax.sharding.Mesh,
    progress: Callable[[Iterator[int], str, int], Iterator[int]] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> MethodRun:
  """Trains ``task`` from scratch with ``method`` and records every step.

  Each record holds ``step`` (1-based), ``loss`` (mean over workers of their
  batch loss), ``step_time_s`` (wall time, blocked), the sparsifier's stats
  (``threshold``, ``transmitted``, ``overflow``, ``selected`` (a diagnostic:
  what passed the threshold before the capacity limit), ``imbalance``,
  ``bytes_sent``, ``partition_starts``, ``partition_sizes``, ``target``: the
  step's ``k``), the achieved ``density`` (transmitted / N) and
  ``sent_over_k`` (transmitted / k: what the user asked for is 1; None, and
  nothing transmitted or sent, on a local step between syncs);
  every ``eval_every`` steps and at the end also the `Task.evaluate` metrics.

  Args:
    method: a name of `demo_methods`.
    task: the `Task`.
    config: the `TrainConfig`.
    mesh: the mesh with axis ``"data"``.
    progress: wraps the step iterator, e.g. in a progress bar:
      ``(iterator, description, total) -> iterator``.
    on_record: called with each record as it is made.

  Returns:
    The `MethodRun`.
  """
  num_workers = mesh.size
  rng = np.random.default_rng(config.seed)
  params = task.init_params(jax.random.key(config.seed))
  num_elements = sum(leaf.size for leaf in jax.tree.leaves(params))
  global_batch = num_workers * config.batch_per_worker
  tx = optimizer_for(method, config, num_workers)
  compiled = compile_method(task, tx, mesh, params, task.sample_batch(rng, global_batch))
  rng = np.random.default_rng(config.seed)  # every method sees the same batches
  opt_state = compiled.opt_state
  evaluate = jax.jit(task.evaluate)

  records = []
  steps: Iterator[int] = iter(range(1, config.steps + 1))
  if progress is not None:
    steps = progress(steps, method, config.steps)
  metrics: dict[str, float] = {}
  exchanges = 0  # the sparsifier's steps so far: under local steps, its syncs
  for step in steps:
    inputs, targets = task.sample_batch(rng, global_batch)
    start = time.perf_counter()
    params, opt_state, losses = compiled.step(params, opt_state, (inputs, targets))
    losses = jax.device_get(losses)  # waits for the step
    seconds = time.perf_counter() - start
    stats = jax.device_get(compiled.dp.stats(opt_state))
    exchanges, before = int(stats.step) + int(stats.skipped_steps), exchanges
    record = _record(step, seconds, losses, stats, asked_count(method, stats, num_workers),
                     num_elements, exchanges > before)
    if step % config.eval_every == 0 or step == config.steps:
      metrics = {name: float(value) for name, value in evaluate(params).items()}
      record.update(metrics)
    records.append(record)
    if on_record is not None:
      on_record(record)
  if not metrics:
    metrics = {name: float(value) for name, value in evaluate(params).items()}
  return MethodRun(method, num_elements, records[-1]["target"], records, metrics,
                   compiled.hlo_bytes, compiled.collectives)
