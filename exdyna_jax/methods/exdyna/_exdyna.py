"""ExDyna: exclusive, rebalanced block partitions and one steered threshold.

The step, top to bottom (`_exdyna_step.partitioned_step`, shared with MiCRO
through a `_partition.Partitioner` value):

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
import types
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from exdyna_jax.core import _options, _stats
from exdyna_jax.exchange import _network
from exdyna_jax.methods.exdyna import _balance, _partition
from exdyna_jax.methods.exdyna._exdyna_step import ExDynaState, partitioned_step, plan_step
from exdyna_jax.selection import _threshold
from exdyna_jax.shell import _density_schedule, _feedback

PARTITIONERS = types.MappingProxyType(
    {partitioner.name: partitioner for partitioner in (_balance.BALANCED, _partition.REFERENCE)})


def exdyna(
    density: float | Mapping[int, float],
    *,
    axis_name: str = "data",
    num_blocks: int | None = None,
    capacity_factor: float | None = None,
    controller: str = "adaptive",
    partitioner: str | _partition.Partitioner | None = None,
    value_dtype: Any = jnp.float32,
    spill: bool | None = None,
    network: _network.Network | None = None,
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
      Or a ``Partitioner`` value (`micro` passes its fixed partitions so).
    value_dtype: float32 (default), bfloat16 or float16: what the exchanged
      values are summed in (:doc:`/usage`).
    spill: with the adaptive controller, all-gather only ``1.2 k / n`` slots
      of each buffer and send the rest through about ``0.3 k`` slots shared
      by all workers: 13-20 % fewer bytes per step, for one more int32
      all-reduce. None (default): spill where the bytes saved take longer
      than that all-reduce's messages on a 25 Gb/s link at 5 us a message
      (at large ``k``: on 8 workers from about ``k = 0.01 N`` at ``N =
      11.2M``; not at ``d = 0.001``); True: wherever it sends fewer bytes
      (slow links); False: never (latency-bound runs).
    network: what a message and a byte cost between your workers
      (`exdyna_jax.Network`, :doc:`/multihost`). Given, the spill (with
      ``spill=None``) is priced on it instead of the 25 Gb/s, 5 us link,
      and the values are all-gathered and summed on each worker where
      that beats their all-reduce on it (dear messages, few values); the
      same update up to the order of the sum's additions. Where one
      all-gather fewer saves more there than
      the ``C`` magnitudes it adds, each worker also selects before the
      threshold is set, and its probe counts ride its index buffer (one
      round fewer, the same selection; :doc:`/multihost`). None
      (default): values all-reduced, the published order of rounds.

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
  if partitioner is None:
    partitioner = "reference" if controller == "reference" else "balanced"
  if isinstance(partitioner, str):
    if partitioner not in PARTITIONERS:
      raise ValueError(
          f"Unknown partitioner {partitioner!r}; expected 'balanced' (default: re-cut every "
          "step from the measured workload) or 'reference' (the published neighbour rule)."
      )
    partitioner = PARTITIONERS[partitioner]
  elif not isinstance(partitioner, _partition.Partitioner):
    raise TypeError(f"partitioner must be 'balanced' or 'reference', got {partitioner!r}.")
  num_blocks = _options.check_num_blocks(num_blocks)
  network = _network.check_network(network)
  spill = _options.check_flag(
      spill, "spill", "send the buffers' tails through shared slots; None: where it pays",
      optional=True)
  levels = _density_schedule.density_levels(density)
  value_dtype = _options.check_value_dtype(value_dtype)
  if capacity_factor is not None:
    capacity_factor = _options.check_capacity_factor(capacity_factor)
  threshold_controller = _threshold.get_controller(controller)

  def init_state(residual, num_elements, num_workers):
    geometry = partitioner.geometry(num_elements, num_workers, num_blocks)
    threshold = threshold_controller.initial_threshold(
        _density_schedule.initial_count(levels, num_elements))
    sizes = _partition.initial_sizes(geometry.num_blocks, num_workers)
    return ExDynaState(
        residual=residual,
        threshold=jnp.float32(threshold),
        partition_sizes=sizes,
        partition_workloads=jnp.zeros((num_workers,), jnp.int32),
        **partitioner.initial_estimate(geometry)._asdict(),
        target_correction=jnp.float32(1.0),
        step=jnp.int32(0),
        stats=_stats.initial_stats(threshold, _partition.starts_of(sizes), sizes),
    )

  def step_for(density):  # the step at one density
    plan_for = functools.partial(
        plan_step, density, partitioner=partitioner, num_blocks=num_blocks,
        capacity_factor=capacity_factor, controller=threshold_controller, spill=spill,
        network=network, value_bytes=jnp.dtype(value_dtype).itemsize)
    return functools.partial(
        partitioned_step, plan_for=plan_for, partitioner=partitioner,
        controller=threshold_controller, axis_name=axis_name, value_dtype=value_dtype)

  return _feedback.error_feedback_transform(
      axis_name=axis_name,
      init_state=init_state,
      step=_density_schedule.scheduled_step(levels, step_for, axis_name),
  )
