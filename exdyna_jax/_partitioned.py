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

import jax
import jax.numpy as jnp
import optax

from exdyna_jax import _exchange, _feedback, _options, _partition, _stats, _threshold


def _window_length(num_elements: int, num_workers: int) -> int:
  """Static slice length for selection: twice a fair share, in whole rows.

  Partitions rebalanced to more than twice the fair share fall back to
  scanning the whole vector (same result, more work).
  """
  fair_share = -(-num_elements // num_workers)
  return min(num_elements, -(-2 * fair_share // _exchange.ROW) * _exchange.ROW)


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
    The optax transformation; its state is an `ErrorFeedbackState` whose
    stats also carry the partitions and workloads the next step starts from.
  """
  density = _options.check_density(density)
  capacity_factor = _options.check_capacity_factor(capacity_factor)
  threshold_controller = _threshold.get_controller(controller)

  def initial_stats(num_elements: int, num_workers: int) -> _stats.SparsifierStats:
    geometry = geometry_fn(num_elements, num_workers)
    target = _options.target_count(density, num_elements)
    sizes = _partition.initial_sizes(geometry.num_blocks, num_workers)
    return _stats.initial_stats(
        threshold_controller.initial_threshold(target), _partition.starts_of(sizes), sizes
    )

  def sparsify(accumulated, stats, num_workers):
    num_elements = accumulated.shape[0]
    geometry = geometry_fn(num_elements, num_workers)
    target = _options.target_count(density, num_elements)
    capacity = _options.capacity(capacity_factor, target, num_workers, num_elements)
    step = stats.step

    # Partitions for this step, from the previous step's workloads.
    sizes = stats.partition_sizes
    if rebalance:
      sizes = jnp.where(step == 0, sizes, _partition.adjust(geometry, sizes, stats.workloads))
    starts = _partition.starts_of(sizes)
    partition = _partition.owned_partition(step, jax.lax.axis_index(axis_name), num_workers)
    begin, end = _partition.element_range(geometry, starts, sizes, partition)

    # One global threshold: the controller counts this worker's partition in
    # place (its cost follows the partition) and sums the counts over workers.
    chunk = _exchange.chunk_length(num_elements, num_workers)

    def measure(thresholds):
      local = _exchange.count_in_range(accumulated, begin, end, thresholds, chunk=chunk)
      return jax.lax.psum(local, axis_name)

    threshold = threshold_controller.choose(
        stats.threshold, stats.selected, target, step, measure
    )

    # Exclusive selection on a static-size window that holds the partition
    # (the whole vector if the partition has outgrown it).
    def select(window):
      return _exchange.select_window(
          window, threshold, begin, end, capacity=capacity, fallback_offset=step
      )

    window_length = _window_length(num_elements, num_workers)
    if window_length < num_elements:
      longest = jnp.max(sizes) * geometry.block_size + geometry.remainder
      selection = jax.lax.cond(
          longest <= window_length,
          lambda: select(_exchange.Window.around(accumulated, begin, window_length)),
          lambda: select(_exchange.Window.whole(accumulated)),
      )
    else:
      selection = select(_exchange.Window.whole(accumulated))
    exchanged = _exchange.exchange(accumulated, selection.indices, selection.sent[None], axis_name)

    sent = exchanged.gathered_info[:, 0]
    selected = jnp.sum(sent)
    transmitted = jnp.sum(jnp.minimum(sent, capacity))
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
        bytes_sent=_stats.static_bytes(
            _exchange.exchange_bytes(num_workers, capacity, 1)
            + _exchange.ring_all_reduce_bytes(
                num_workers, threshold_controller.num_probes * _exchange.INDEX_BYTES
            )
        ),
    )
    return exchanged.sparse, new_stats

  return _feedback.error_feedback_transform(
      axis_name=axis_name, initial_stats=initial_stats, sparsify=sparsify
  )
