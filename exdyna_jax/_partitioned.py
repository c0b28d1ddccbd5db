"""Threshold sparsification over rotating, disjoint partitions (ExDyna, MiCRO).

Both methods cut the flat gradient into ``n`` contiguous partitions; at step
``t`` worker ``w`` selects ``|a| >= threshold`` only inside partition
``(t mod n + w) mod n``, so the workers' selections never overlap and the
union of what they send is exactly ``k``-sized (no gradient build-up). They
differ in the unit a partition is measured in (blocks for ExDyna, single
elements for MiCRO) and in whether partitions are rebalanced every step.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax import _exchange, _layout, _options, _partition, _stats, _threshold


class PartitionedState(NamedTuple):
  """Optimizer state of a partitioned threshold sparsifier (per worker).

  Attributes:
    residual: float32 ``[N]`` error-feedback memory of this worker: what it
      accumulated and has not yet had transmitted.
    controller: memory of the threshold controller.
    stats: `SparsifierStats` of the last step; also the partition sizes and
      workloads the next step rebalances from.
  """

  residual: jax.Array
  controller: _threshold.ControllerState
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
        residual=jnp.zeros((config.layout.num_elements,), _layout.ACCUMULATION_DTYPE),
        controller=threshold_controller.init(),
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

    # Controls for this step, from the previous step's global counts.
    threshold, controller_state = threshold_controller.next_threshold(
        stats.threshold, state.controller, stats.selected, config.target
    )
    threshold = jnp.where(first, stats.threshold, threshold)
    controller_state = jax.tree.map(
        lambda old, new: jnp.where(first, old, new), state.controller, controller_state
    )
    sizes = stats.partition_sizes
    if rebalance:
      sizes = jnp.where(first, sizes, _partition.adjust(geometry, sizes, stats.workloads))
    starts = _partition.starts_of(sizes)

    # Exclusive selection in the owned partition, then the shared exchange.
    worker = jax.lax.axis_index(axis_name)
    partition = _partition.owned_partition(step, worker, num_workers)
    begin, end = _partition.element_range(geometry, starts, sizes, partition)
    accumulated = _layout.flatten(updates) + state.residual
    selection = _exchange.select_window(
        accumulated,
        threshold,
        begin,
        end,
        capacity=config.capacity,
        probe_ratios=threshold_controller.probe_ratios,
        fallback_offset=step,
    )
    side_info = jnp.concatenate([selection.sent[None], selection.probe_counts])
    exchanged = _exchange.exchange(accumulated, selection.indices, side_info, axis_name)

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
        bytes_sent=jnp.int32(
            _exchange.exchange_bytes(num_workers, config.capacity, side_info.shape[0])
        ),
    )
    new_state = PartitionedState(
        residual=exchanged.residual,
        controller=controller_state._replace(
            probe_counts=jnp.sum(exchanged.gathered_info[:, 1:], axis=0)
        ),
        stats=new_stats,
    )
    return _layout.unflatten(exchanged.update, config.layout), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
