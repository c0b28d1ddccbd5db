"""ExDyna's step, stage by stage, for any `_partition.Partitioner` (MiCRO's too).

`partitioned_step` runs stages 2-5 of `exdyna_jax.methods.exdyna._exdyna`'s list, each a
call: cut this step's partitions and find the one this worker owns, choose
the global threshold, select in the worker's own partition, exchange; then
`next_state` (stage 7) keeps what the next step cuts its partitions from and
the step's telemetry. `plan_step` fixes the static sizes at one density.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _collectives, _layout, _options, _stats
from exdyna_jax.exchange import _exchange, _network, _spill
from exdyna_jax.methods.exdyna import _early_selection, _partition
from exdyna_jax.selection import _selection, _threshold


class ExDynaState(NamedTuple):
  """Optimizer state of `exdyna` and `micro` (per worker).

  Everything but ``residual`` is identical on every worker.

  Attributes:
    residual: float32 ``[N]`` error-feedback memory of this worker: what it
      accumulated and has not yet had transmitted.
    threshold: float32 the threshold of the last step (before the first: the
      one the first step starts from).
    partition_sizes: int32 ``[n]`` blocks (MiCRO: elements) per partition at
      the last step; partition ``p`` starts where ``p - 1`` ends.
    partition_workloads: int32 ``[n]`` elements of each partition that
      passed the threshold at the last step, before the capacity limit (1
      where only the fallback index was sent): the published rules' input.
    block_workloads: float32 ``[B]`` the balanced partitioner's smoothed
      share of the selections in each block (None for the other
      partitioners).
    worker_scales: float32 ``[n]`` the balanced partitioner's estimate of
      how much more each worker selects than the block estimate predicts
      (None for the other partitioners).
    target_correction: float32 the adaptive controller's factor on ``k``,
      learned from the indices it transmitted (it removes the bias of
      interpolating between probes; 1 at first, and always for the reference
      rule).
    step: int32 completed steps (skipped non-finite steps not counted).
    stats: `SparsifierStats`, the last step's telemetry (what
      `exdyna_jax.get_stats` returns); the step reads only ``stats.step``,
      the count of every step (``step`` above skips a density schedule's
      dense ones).
    leaves_seen: `_layout.LeavesSeen`, static: which leaves of the params
      tree ``init`` saw (None in a state unpickled from before it).

  Example:
    Two steps on 4 workers simulated with ``jax.vmap``; the gradient is ten
    times larger in the last quarter of ``N = 8192`` elements:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.exdyna(density=0.01, num_blocks=64)
    >>> params = jnp.zeros(8192)
    >>> scale = jnp.where(jnp.arange(8192) < 6144, 1.0, 10.0)
    >>> grads = scale * jax.random.normal(jax.random.key(0), (4, 8192))
    >>> def two_steps(g):  # runs per worker
    ...   state = tx.init(params)
    ...   first = tx.update(g, state, params)[1]
    ...   return first, tx.update(g, first, params)[1]
    >>> first, second = jax.jit(jax.vmap(two_steps, axis_name="data", axis_size=4))(grads)
    >>> type(second).__name__, second.residual.shape  # [worker, N]: a residual each
    ('ExDynaState', (4, 8192))

    The first step used four equal partitions of 16 blocks; it measured that
    nearly all selections fall in the last 16 blocks, so the second step cut
    those into three partitions:

    >>> print(first.partition_sizes[0], second.partition_sizes[0])
    [16 16 16 16] [50  5  4  5]
    >>> print(round(float(first.block_workloads[0, 48:].sum()), 2))
    0.99
  """

  residual: jax.Array
  threshold: jax.Array
  partition_sizes: jax.Array
  partition_workloads: jax.Array
  block_workloads: jax.Array
  worker_scales: jax.Array
  target_correction: jax.Array
  step: jax.Array
  stats: _stats.SparsifierStats
  leaves_seen: _layout.LeavesSeen | None = None


class StepPlan(NamedTuple):
  """The static sizes of one step at one density (Python ints, fixed when traced).

  Attributes:
    geometry: the block layout.
    budget: ``k``, the buffer size ``C`` and the values summed.
    packed_slots: value slots when the gathered indices are packed first
      (fewer than the ``n C`` buffer slots), else None.
    spill: where the buffers' tails spill, or None (whole buffers).
    chunk: elements a partition is read in per iteration.
    unrolled: iterations over a partition unrolled on GPUs
      (`_selection.over_chunks`).
    gather_values: whether the values are all-gathered and summed on each
      worker instead of all-reduced (`_network.gather_pays`).
    select_first: whether each worker selects before the threshold is set
      and its probe counts ride its index buffer (`select_then_threshold`).
  """

  geometry: _partition.BlockGeometry
  budget: _threshold.Budget
  packed_slots: int | None
  spill: _spill.Spill | None
  chunk: int
  unrolled: int
  gather_values: bool
  select_first: bool


def plan_step(
    density: float,
    num_elements: int,
    num_workers: int,
    *,
    partitioner: _partition.Partitioner,
    num_blocks: int | None,
    capacity_factor: float | None,
    controller: _threshold.ThresholdController,
    spill: bool | None,
    network: _network.Network | None = None,
    value_bytes: int = _collectives.VALUE_BYTES,
) -> StepPlan:
  """The `StepPlan` of ``N`` elements on ``n`` workers at ``density``.

  The published exchange gathers and sums every buffer slot; a steered
  density (a controller with probes) lets the gathered indices be packed
  into about ``k`` value slots and the buffers' tails spill into shared
  slots (`_spill.choose_spill`). On a ``network`` the user describes, the
  spill is priced on it, the values (``value_bytes`` each) are
  all-gathered where that is faster than their all-reduce there, and the
  probe counts ride the index buffers where that is (`_early_selection.pays`).
  """
  geometry = partitioner.geometry(num_elements, num_workers, num_blocks)
  target = _options.target_count(density, num_elements)
  factor = capacity_factor or _options.default_capacity_factor(
      target, num_workers, controller.name)
  capacity = _options.capacity(factor, target, num_workers, num_elements)
  slots, spill_layout = num_workers * capacity, None
  if controller.num_probes:
    slots = _options.value_slots(target, capacity, num_workers)
    spill_layout = _spill.choose_spill(
        spill, target, capacity, num_workers, network or _network.NOMINAL)
  chunk = _selection.chunk_length(num_elements, num_workers)
  return StepPlan(
      geometry=geometry,
      budget=_threshold.Budget(target, capacity, slots),
      packed_slots=slots if slots < num_workers * capacity else None,
      spill=spill_layout,
      chunk=chunk,
      unrolled=_selection.unrolled_chunks(num_elements, num_workers, chunk),
      gather_values=network is not None and _network.gather_pays(
          network, num_workers, slots * value_bytes),
      select_first=(network is not None and controller.num_probes > 0 and spill_layout is None
                    and _early_selection.pays(
                        network, num_workers, capacity, controller.num_probes)),
  )


def partitioned_step(
    accumulated: jax.Array,
    state: ExDynaState,
    num_workers: int,
    *,
    plan_for: Callable[[int, int], StepPlan],
    partitioner: _partition.Partitioner,
    controller: _threshold.ThresholdController,
    axis_name: str,
    value_dtype: Any,
) -> tuple[_exchange.SparseUpdate, ExDynaState]:
  """Stages 2-5 of `_exdyna`'s list: partitions, threshold, selection, exchange.

  Args:
    accumulated: float32 ``[N]`` this worker's ``g + m``.
    state: the `ExDynaState` the last step left.
    num_workers: ``n``.
    plan_for: ``(N, n) -> `` the step's static sizes (`plan_step` at a density).
    partitioner: how the partitions are cut and what they learn.
    controller: the threshold rule.
    axis_name: the data-parallel axis.
    value_dtype: what the values are summed in.

  Returns:
    ``(sparse update, new state)``; the shell writes the residual.
  """
  plan = plan_for(accumulated.shape[0], num_workers)
  t, geometry = state.step, plan.geometry
  estimate = _partition.PartitionEstimate(state.block_workloads, state.worker_scales)

  # Partitions for this step, and the one this worker owns.
  sizes = partitioner.cut(estimate, geometry, state.partition_sizes, state.partition_workloads, t)
  partition = _partition.owned_partition(t, jax.lax.axis_index(axis_name), num_workers)
  begin, end = _partition.element_range(geometry, _partition.starts_of(sizes), sizes, partition)

  # One global threshold, from every worker's count of its own partition;
  # exclusive selection in the worker's own partition; the exchange.
  budget = plan.budget
  if plan.select_first:  # one round fewer: the probe counts ride the index buffers
    threshold, steady, exchanged = select_then_threshold(
        accumulated, state, plan, controller, begin, end, axis_name=axis_name,
        value_dtype=value_dtype)
  else:  # the published order: the probe counts (if any), the threshold, the selection
    probe = None
    if controller.num_probes:
      probe = _threshold.measure_partitions(
          accumulated, begin, end, _threshold.probe_thresholds(state.threshold),
          chunk=plan.chunk, unrolled=plan.unrolled, axis_name=axis_name)
    threshold, steady = controller.choose(
        state.threshold, jnp.sum(state.partition_workloads), budget, state.target_correction,
        t, probe)
    selection = _selection.select_in_range(
        accumulated, threshold, begin, end, capacity=budget.capacity, chunk=plan.chunk,
        unrolled=plan.unrolled, fallback_offset=t)
    exchanged = _exchange.exchange(
        accumulated, selection.indices, selection.passed[None], axis_name,
        value_slots=plan.packed_slots, value_dtype=value_dtype, spill=plan.spill,
        gather_values=plan.gather_values)
  estimate = partitioner.observe(
      estimate, geometry, sizes=sizes, step=t, gathered_indices=exchanged.gathered_indices,
      passed=exchanged.gathered_info[:, 0],
  )
  return exchanged.sparse, next_state(
      state, plan, controller, threshold=threshold, steady=steady, sizes=sizes,
      exchanged=exchanged, estimate=estimate,
  )


def select_then_threshold(
    accumulated: jax.Array, state: ExDynaState, plan: StepPlan,
    controller: _threshold.ThresholdController, begin: jax.Array, end: jax.Array, *,
    axis_name: str, value_dtype: Any,
) -> tuple[jax.Array, jax.Array, _exchange.Exchanged]:
  """Stages 3-5 in one round fewer: the probe counts ride the index buffers.

  Each worker selects at its floor before the threshold is set, and one
  all-gather moves the counts with the buffers (`_early_selection`); every
  worker then sets the threshold and keeps what passes it, exactly what
  the published order sends (`partitioned_step`). Where some buffer does not
  hold all that passes, the step selects and gathers again, as that order
  does (a step of the same rounds as it, not counted in ``bytes_sent``).
  The values follow as there.

  Returns:
    ``(threshold, steady, exchanged)``.
  """
  budget, num_elements = plan.budget, accumulated.shape[0]
  candidates = _early_selection.gather_candidates(
      accumulated, state.threshold, begin, end, capacity=budget.capacity, chunk=plan.chunk,
      unrolled=plan.unrolled, fallback_offset=state.step, axis_name=axis_name)
  threshold, steady = controller.choose(
      state.threshold, jnp.sum(state.partition_workloads), budget, state.target_correction,
      state.step, candidates.probe,
  )

  def kept():
    indices, passed = _early_selection.keep_passing(candidates, threshold, num_elements)
    return indices, passed[:, None]

  def selected_again():  # some buffer is short of what passes: the two-round exchange's
    with jax.named_scope(_early_selection.SELECTED_AGAIN_SCOPE):
      selection = _selection.select_in_range(
          accumulated, threshold, begin, end, capacity=budget.capacity, chunk=plan.chunk,
          unrolled=plan.unrolled, fallback_offset=state.step)
      return _exchange.gather_indices(selection.indices, selection.passed[None], axis_name)

  indices, info = jax.lax.cond(
      _early_selection.holds_every_pass(candidates, threshold, budget.capacity),
      kept, selected_again)
  sparse = _exchange.aggregate_at(accumulated, indices, axis_name, value_dtype,
                                  slots=plan.packed_slots, gather=plan.gather_values)
  # The magnitudes, floor and fallback ride the buffers; the probe counts
  # (`_threshold.control_bytes`) are added with every controller's.
  side_info = budget.capacity + _early_selection.SIDE_WORDS
  bytes_sent = _exchange.exchange_bytes(
      indices.shape[0], budget.capacity, side_info, plan.packed_slots,
      jnp.dtype(value_dtype).itemsize, None, plan.gather_values)
  return threshold, steady, _exchange.Exchanged(sparse, indices, info, bytes_sent)


def next_state(
    state: ExDynaState,
    plan: StepPlan,
    controller: _threshold.ThresholdController,
    *,
    threshold: jax.Array,
    steady: jax.Array,
    sizes: jax.Array,
    exchanged: _exchange.Exchanged,
    estimate: _partition.PartitionEstimate,
) -> ExDynaState:
  """Stage 7: what the next step cuts its partitions from, and the step's telemetry.

  Each worker's pass count rides on its index buffer (before the capacity
  limit); a worker that sent only its fallback index selected 1.
  """
  t, budget, num_workers = state.step, plan.budget, plan.geometry.num_workers
  selected_per_worker = jnp.maximum(exchanged.gathered_info[:, 0], 1)
  workloads = _partition.by_partition(selected_per_worker, t)
  selected = jnp.sum(selected_per_worker)
  transmitted = jnp.minimum(
      jnp.sum(exchanged.gathered_indices < plan.geometry.num_elements), budget.slots)
  bytes_sent = exchanged.bytes_sent + _threshold.control_bytes(controller, num_workers)
  stats = state.stats._replace(  # the shell's guard advances stats.step
      threshold=threshold,
      selected=selected,
      transmitted=transmitted,
      overflow=selected - transmitted,
      workloads=workloads,
      imbalance=_stats.imbalance_of(workloads),
      partition_starts=_partition.starts_of(sizes),
      partition_sizes=sizes,
      **_stats.bytes_fields(state.stats, bytes_sent),
      target=jnp.int32(budget.target),
  )
  return ExDynaState(
      residual=state.residual,  # the shell writes the new one
      threshold=threshold,
      partition_sizes=sizes,
      partition_workloads=workloads,
      **estimate._asdict(),
      target_correction=_threshold.correct(
          state.target_correction, transmitted, budget.target, steady),
      step=t + 1,
      stats=stats,
  )
