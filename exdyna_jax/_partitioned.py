"""Threshold sparsification over rotating, disjoint partitions (ExDyna, MiCRO).

Both methods cut the flat gradient into ``n`` contiguous partitions; at step
``t`` worker ``w`` selects ``|a| >= threshold`` only inside partition
``(t mod n + w) mod n``, so the workers' selections never overlap and the
union of what they send is exactly ``k``-sized (no gradient build-up). They
differ in the unit a partition is measured in (blocks for ExDyna, single
elements for MiCRO) and in whether partitions are rebalanced every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax import _exchange, _layout, _options, _partition, _stats, _threshold


class PartitionedState(NamedTuple):
  """Optimizer state of a partitioned threshold sparsifier (per worker).

  Attributes:
    residual: float32 ``[N]`` error-feedback memory of this worker: what it
      accumulated and has not yet had transmitted.
    stats: `SparsifierStats` of the last step; also the partition sizes and
      workloads the next step rebalances from.
  """

  residual: jax.Array
  stats: _stats.SparsifierStats


class _Setup(NamedTuple):
  layout: _layout.FlatLayout
  geometry: _partition.BlockGeometry
  target: int
  capacity: int


def partitioned_sparsifier(
    density: float,
    *,
    axis_name: str,
    capacity_factor: float,
    controller: str,
    geometry_fn: Callable[[int, int], _partition.BlockGeometry],
    rebalance: bool,
) -> optax.GradientTransformationExtraArgs:
  """Builds a partitioned threshold sparsifier.

  Args:
    density: fraction ``d`` of elements to send per step.
    axis_name: the data-parallel axis.
    capacity_factor: per-worker buffer size as a multiple of ``k / n``.
    controller: ``"adaptive"`` or ``"reference"``.
    geometry_fn: ``(N, n) -> BlockGeometry`` (validates and raises).
    rebalance: whether to run ExDyna's partition adjustment every step.

  Returns:
    The optax transformation.
  """
  density = _options.check_density(density)
  capacity_factor = _options.check_capacity_factor(capacity_factor)
  threshold_controller = _threshold.get_controller(controller)

  def setup(tree: Any, what: str) -> _Setup:
    layout = _layout.layout_of(tree, what=what)
    num_workers = _exchange.axis_size(axis_name)
    geometry = geometry_fn(layout.num_elements, num_workers)
    target = _options.target_count(density, layout.num_elements)
    capacity = _options.capacity(capacity_factor, target, num_workers, layout.num_elements)
    return _Setup(layout, geometry, target, capacity)

  def init_fn(params):
    config = setup(params, "params")
    sizes = _partition.initial_sizes(config.geometry.num_blocks, config.geometry.num_workers)
    return PartitionedState(
        residual=_exchange.per_worker(
            jnp.zeros((config.layout.num_elements,), _layout.ACCUMULATION_DTYPE), axis_name
        ),
        stats=_stats.initial_stats(
            threshold_controller.initial_threshold(config.target),
            _partition.starts_of(sizes),
            sizes,
        ),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    config = setup(updates, "gradient")
    if params is not None:
      _layout.check_same_layout(
          _layout.layout_of(params, what="params"), config.layout, what="gradient"
      )
    if state.residual.shape != (config.layout.num_elements,):
      raise ValueError(
          f"The gradient has {config.layout.num_elements} elements but the optimizer "
          f"state was initialized for {state.residual.shape[0]}. Call init() with the "
          "same tree you pass to update()."
      )
    _exchange.check_local(updates, axis_name)
    geometry = config.geometry
    num_workers = geometry.num_workers
    stats = state.stats
    step = stats.step
    first = step == 0

    # Partitions for this step, from the previous step's workloads.
    sizes = stats.partition_sizes
    if rebalance:
      sizes = jnp.where(first, sizes, _partition.adjust(geometry, sizes, stats.workloads))
    starts = _partition.starts_of(sizes)
    worker = jax.lax.axis_index(axis_name)
    partition = _partition.owned_partition(step, worker, num_workers)
    begin, end = _partition.element_range(geometry, starts, sizes, partition)
    accumulated = _layout.flatten(updates) + state.residual

    # One global threshold, then exclusive selection and the shared exchange.
    def measure(thresholds):
      local = _exchange.count_in_window(accumulated, begin, end, thresholds)
      return jax.lax.psum(local, axis_name)

    threshold = threshold_controller.choose(
        stats.threshold, stats.selected, config.target, step, measure
    )
    selection = _exchange.select_window(
        accumulated, threshold, begin, end, capacity=config.capacity, fallback_offset=step
    )
    exchanged = _exchange.exchange(
        accumulated, selection.indices, selection.sent[None], axis_name
    )

    sent = exchanged.gathered_info[:, 0]
    selected = jnp.sum(sent)
    transmitted = jnp.sum(jnp.minimum(sent, config.capacity))
    workloads = _partition.by_partition(sent, step)
    new_stats = _stats.SparsifierStats(
        step=step + 1,
        threshold=threshold,
        selected=selected,
        transmitted=transmitted,
        overflow=selected - transmitted,
        workloads=workloads,
        imbalance=_stats.imbalance_of(workloads),
        partition_starts=starts,
        partition_sizes=sizes,
        bytes_sent=jnp.int32(_exchange.exchange_bytes(num_workers, config.capacity, 1)),
    )
    new_state = PartitionedState(residual=exchanged.residual, stats=new_stats)
    return _layout.unflatten(exchanged.update, config.layout), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
