"""ExDyna: exclusive, rebalanced block partitions and one steered threshold.

The step, top to bottom (`_partitioned_transform`, shared with MiCRO):

1. accumulate: ``a = g + m`` (the error-feedback shell, `_feedback`);
2. partitions: cut this step's partitions (balanced: from the workload
   estimate; reference: the published neighbour rule; MiCRO: fixed) and
   find the one this worker owns (rotation);
3. threshold: the controller picks one global threshold (adaptive: it
   measures this step's count curve);
4. select: ``|a| >= threshold`` inside the worker's own partition, at most
   ``C`` indices (the lowest), or the fallback index when nothing passes;
5. exchange: all-gather the index buffers (with the pass counts; adaptive:
   their heads, the tails spilling into shared slots), sum the values there;
6. residual: the shell clears every transmitted index in ``a``;
7. state and stats: what the next step cuts its partitions from, and telemetry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax import (
  _balance,
  _density_schedule,
  _exchange,
  _feedback,
  _options,
  _partition,
  _selection,
  _stats,
  _threshold,
)

PARTITIONERS = ("balanced", "reference")

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
      share of the selections in each block (empty for the other
      partitioners).
    worker_scales: float32 ``[n]`` the balanced partitioner's estimate of
      how much more each worker selects than the block estimate predicts
      (empty for the other partitioners).
    target_correction: float32 the adaptive controller's factor on ``k``,
      learned from the indices it transmitted (it removes the bias of
      interpolating between probes; 1 at first, and always for the reference
      rule).
    step: int32 completed steps (skipped non-finite steps not counted).
    stats: `SparsifierStats`, the last step's telemetry (what
      `exdyna_jax.get_stats` returns); the step reads none of it.

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
    >>> first, second = jax.vmap(two_steps, axis_name="data", axis_size=4)(grads)
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


def exdyna(
    density: float | Mapping[int, float],
    *,
    axis_name: str = "data",
    num_blocks: int | None = None,
    capacity_factor: float | None = None,
    controller: str = "adaptive",
    partitioner: str | None = None,
    value_dtype: Any = jnp.float32,
    spill: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """ExDyna gradient sparsification with error feedback, as an optax transform.

  Each worker adds its local gradient to its residual, selects the elements of
  the accumulated gradient at or above one global threshold *inside its own
  partition only*, and the workers exchange indices (``all_gather``) and sum
  the values there (``psum``). The result is the mean of all workers'
  accumulated gradients at the transmitted indices, zero elsewhere, identical
  on every worker; everything else stays in each worker's residual.

  The flat gradient is cut into blocks; ``n`` runs of contiguous blocks form
  the partitions, which rotate among workers every step. By default
  (``partitioner="balanced"``) all partitions are re-cut every step from a
  smoothed per-block workload estimate and each worker's measured scale, so
  every worker expects ``k / n`` selections; the threshold is steered so
  that ``k = floor(density * N)`` indices are *transmitted* per step.

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    density: fraction of gradient elements to send per step, in ``(0, 1]``. Or a schedule
      ``{first_step: density}`` (`dgc_warmup`, :doc:`/usage`).
    axis_name: name of the data-parallel axis.
    num_blocks: number of blocks ``B``. None (default): for the balanced
      partitioner up to 1024 per worker of at least 32 elements (fewer for a
      small model); for the reference one the published 1024.
    capacity_factor: per-worker index buffer size ``C`` as a multiple of
      ``k / n``; elements past it stay in the residual and are counted as
      overflow. None (default): ``2.3 + 4 / sqrt(k / n)`` with the adaptive
      controller (room for a partition's step-to-step swings, about +-35 %
      on real models, and for counting noise), 1.5 with the reference one.
      With the adaptive controller about ``1.1 k`` values are summed,
      whatever ``C``.
    controller: ``"adaptive"`` (default) measures this step's count curve and
      transmits ``k`` indices within a few percent from the first tens of
      steps; ``"reference"`` reproduces the published rule exactly (float32
      threshold arithmetic).
    partitioner: ``"balanced"`` (re-cut every step from the measured
      workload) or ``"reference"`` (the published layout, blocks of a
      multiple of 32 elements with the remainder in the last partition, and
      the published neighbour rule, bit for bit). None (default):
      ``"reference"`` when ``controller="reference"``, else ``"balanced"``.
    value_dtype: float32 (default), bfloat16 or float16: what the exchanged
      values are summed in (:doc:`/usage`).
    spill: with the adaptive controller, all-gather only ``1.2 k / n`` slots
      of each buffer and send the rest through about ``0.3 k`` slots shared
      by all workers (default): 13-20 % fewer bytes per step, for one more
      int32 all-reduce. False gathers whole buffers: one message fewer, for
      latency-bound runs (many workers, small ``k``, fast links).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    `ExDynaState`.

  References:
    Yoon & Oh, "Preserving Near-Optimal Gradient Sparsification Cost for
    Scalable Distributed Deep Learning", CCGrid 2024, arXiv:2402.13781.

  Example:
    Eight workers simulated with ``jax.vmap``, each with its own gradients,
    for 20 steps; ``N = 4096`` elements and ``density=0.01`` give ``k = 40``:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> n, k = 8, 40
    >>> tx = exdyna_jax.exdyna(density=0.01)
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> def train(grads):  # runs per worker
    ...   state = tx.init(params)
    ...   def step(state, g):
    ...     updates, state = tx.update({"w": g}, state, params)
    ...     return state, updates
    ...   state, updates = jax.lax.scan(step, state, grads)
    ...   return updates["w"][-1], exdyna_jax.get_stats(state)
    >>> scale = jnp.linspace(0.1, 2.0, 4096).reshape(64, 64)  # larger further along
    >>> grads = scale * jax.random.normal(jax.random.key(0), (n, 20, 64, 64))
    >>> update, stats = jax.jit(jax.vmap(train, axis_name="data", axis_size=n))(grads)

    The update is identical on every worker and nonzero exactly at the
    ``transmitted`` indices, about ``k`` of them:

    >>> bool((update == update[0]).all())
    True
    >>> int((update[0] != 0).sum()) == int(stats.transmitted[0])
    True
    >>> bool(0.9 <= stats.transmitted[0] / k <= 1.1)
    True

    The 128 blocks of 32 elements started as 8 partitions of 16; the
    partitions over the large gradients at the end are now the shorter ones:

    >>> sizes = stats.partition_sizes[0]
    >>> int(sizes.sum()), bool(sizes[0] > 16 > sizes[-1])
    (128, True)
  """
  blocks = _options.check_num_blocks(num_blocks)
  spill = _options.check_flag(spill, "spill", "send the buffers' tails through shared slots")
  if partitioner is None:
    partitioner = "reference" if controller == "reference" else "balanced"
  if partitioner not in PARTITIONERS:
    raise ValueError(
        f"Unknown partitioner {partitioner!r}; expected 'balanced' (default: re-cut every "
        "step from the measured workload) or 'reference' (the published neighbour rule)."
    )
  if partitioner == "balanced":
    geometry_fn = functools.partial(_balance.balanced_geometry, num_blocks=blocks)
  else:
    geometry_fn = lambda n_elements, n_workers: _partition.block_geometry(  # noqa: E731
        n_elements, _partition.REFERENCE_NUM_BLOCKS if blocks is None else blocks, n_workers
    )
  return _partitioned_transform(
      density, axis_name=axis_name, capacity_factor=capacity_factor, controller=controller,
      geometry_fn=geometry_fn, partitioner=partitioner, value_dtype=value_dtype, spill=spill,
  )


def _partitioned_transform(
    density: float | Mapping[int, float],
    *,
    axis_name: str,
    capacity_factor: float | None,
    controller: str,
    geometry_fn: Callable[[int, int], _partition.BlockGeometry],
    partitioner: str,
    value_dtype: Any = jnp.float32,
    spill: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """The step of ExDyna and MiCRO, for one partitioner.

  Args:
    density: fraction ``d`` of elements to send per step, or a schedule
      ``{first_step: density}`` (`_density_schedule`).
    axis_name: the data-parallel axis.
    capacity_factor: per-worker buffer size as a multiple of ``k / n``, or
      None for `_options.default_capacity_factor`.
    controller: ``"adaptive"`` or ``"reference"``.
    geometry_fn: ``(N, n) -> BlockGeometry`` (validates and raises).
    partitioner: ``"balanced"``, ``"reference"`` (the published neighbour
      rule) or ``"static"`` (partitions never move: MiCRO).
    value_dtype: the dtype the values are summed in.
    spill: whether buffers' tails spill into shared slots (adaptive only).

  Returns:
    The optax transformation; its state is an `ExDynaState`.
  """
  levels = _density_schedule.density_levels(density)
  value_dtype = _options.check_value_dtype(value_dtype)
  if capacity_factor is not None:
    capacity_factor = _options.check_capacity_factor(capacity_factor)
  threshold_controller = _threshold.get_controller(controller)
  balanced = partitioner == "balanced"

  def init_state(residual, num_elements, num_workers):
    geometry = geometry_fn(num_elements, num_workers)
    target = _density_schedule.initial_count(levels, num_elements)
    sizes = _partition.initial_sizes(geometry.num_blocks, num_workers)
    if balanced:
      block_workloads, worker_scales = _balance.initial_estimate(geometry)
    else:
      block_workloads = worker_scales = jnp.zeros((0,), jnp.float32)
    threshold = threshold_controller.initial_threshold(target)
    return ExDynaState(
        residual=residual,
        threshold=jnp.float32(threshold),
        partition_sizes=sizes,
        partition_workloads=jnp.zeros((num_workers,), jnp.int32),
        block_workloads=block_workloads,
        worker_scales=worker_scales,
        target_correction=jnp.float32(1.0),
        step=jnp.int32(0),
        stats=_stats.initial_stats(threshold, _partition.starts_of(sizes), sizes),
    )

  def step_for(density):  # the step at one density
    def step(accumulated, state, num_workers):
      num_elements = accumulated.shape[0]
      geometry = geometry_fn(num_elements, num_workers)
      target = _options.target_count(density, num_elements)
      factor = capacity_factor or _options.default_capacity_factor(target, num_workers, controller)
      capacity = _options.capacity(factor, target, num_workers, num_elements)
      # The published exchange gathers and sums every buffer slot; a steered
      # density lets the buffers' tails spill into shared slots and the
      # gathered indices be packed into about k value slots.
      slots, spill_layout = num_workers * capacity, None
      if threshold_controller.num_probes:
        slots = _options.value_slots(target, capacity, num_workers)
        spill_layout = _exchange.default_spill(target, capacity, num_workers) if spill else None
      budget = _threshold.Budget(target, capacity, slots)
      t = state.step

      # Partitions for this step, and the one this worker owns.
      if balanced:
        sizes = _balance.cut(_balance.BalanceEstimate(state.block_workloads, state.worker_scales),
                             geometry, t)
      elif partitioner == "reference":
        adjusted = _partition.adjust(geometry, state.partition_sizes, state.partition_workloads)
        sizes = jnp.where(t == 0, state.partition_sizes, adjusted)
      else:
        sizes = state.partition_sizes
      starts = _partition.starts_of(sizes)
      partition = _partition.owned_partition(t, jax.lax.axis_index(axis_name), num_workers)
      begin, end = _partition.element_range(geometry, starts, sizes, partition)

      # One global threshold, from every worker's count of its own partition.
      chunk = _selection.chunk_length(num_elements, num_workers)
      measure = _threshold.measure_partitions(
          accumulated, begin, end, chunk=chunk, axis_name=axis_name
      )
      threshold, steady = threshold_controller.choose(
          state.threshold, jnp.sum(state.partition_workloads), budget, state.target_correction, t,
          measure,
      )

      # Exclusive selection: the worker's own partition only, read chunk by chunk.
      selection = _selection.select_in_range(
          accumulated, threshold, begin, end, capacity=capacity, chunk=chunk, fallback_offset=t
      )

      # Exchange: index buffers with each worker's pass count, values summed.
      packed = slots if slots < num_workers * capacity else None
      exchanged = _exchange.exchange(
          accumulated, selection.indices, selection.passed[None], axis_name, value_slots=packed,
          value_dtype=value_dtype, spill=spill_layout,
      )
      # Per worker: elements over the threshold and the indices it chose from
      # them (the fallback index when none passed), before the capacity limit.
      passed_per_worker = exchanged.gathered_info[:, 0]
      selected_per_worker = jnp.maximum(passed_per_worker, 1)
      workloads = _partition.by_partition(selected_per_worker, t)

      # What the next step cuts its partitions from.
      if balanced:
        block_workloads, worker_scales = _balance.observe(
            _balance.BalanceEstimate(state.block_workloads, state.worker_scales), geometry,
            sizes=sizes, step=t, gathered_indices=exchanged.gathered_indices,
            passed=passed_per_worker,
        )
      else:
        block_workloads, worker_scales = state.block_workloads, state.worker_scales

      selected = jnp.sum(selected_per_worker)
      transmitted = jnp.minimum(jnp.sum(exchanged.gathered_indices < num_elements), slots)
      stats = _stats.SparsifierStats(
          step=state.stats.step + 1,  # all steps (a density schedule's dense ones too)
          threshold=threshold,
          selected=selected,
          transmitted=transmitted,
          overflow=selected - transmitted,
          workloads=workloads,
          imbalance=_stats.imbalance_of(workloads),
          partition_starts=starts,
          partition_sizes=sizes,
          bytes_sent=_stats.static_bytes(
              _exchange.exchange_bytes(
                  num_workers, capacity, 1, packed, value_dtype.itemsize, spill_layout
              )
              + _threshold.control_bytes(threshold_controller, num_workers)
          ),
      )
      new_state = ExDynaState(
          residual=state.residual,  # the shell writes the new one
          threshold=threshold,
          partition_sizes=sizes,
          partition_workloads=workloads,
          block_workloads=block_workloads,
          worker_scales=worker_scales,
          target_correction=_threshold.correct(
              state.target_correction, transmitted, target, steady
          ),
          step=t + 1,
          stats=stats,
      )
      return exchanged.sparse, new_state

    return step

  return _feedback.error_feedback_transform(
      axis_name=axis_name,
      init_state=init_state,
      step=_density_schedule.scheduled_step(levels, step_for, axis_name),
  )

