"""MiCRO: exclusive, static element partitions."""

from __future__ import annotations

import optax

from exdyna_jax import _partition, _partitioned

DEFAULT_CAPACITY_FACTOR = 1.5


def micro(
    density: float,
    *,
    axis_name: str = "data",
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
    controller: str = "adaptive",
) -> optax.GradientTransformationExtraArgs:
  """MiCRO gradient sparsification with error feedback, as an optax transform.

  ExDyna without blocks and without partition adjustment: the flat gradient
  is cut once into ``n`` contiguous partitions of ``floor(N / n)`` elements
  (one more for the first ``N mod n``). At step ``t`` worker ``w`` selects
  ``|a| >= threshold`` inside partition ``(t mod n + w) mod n`` only (or the
  single index ``start + t mod len`` when nothing passes); the workers
  exchange indices and sum values there, exactly as in `exdyna`. The
  selections are disjoint, so there is no gradient build-up, but nothing
  evens out the partitions' workloads: when gradient magnitude is uneven
  along the flat vector, ``stats.imbalance`` stays high and the fullest
  buffer sets the traffic (elements past ``capacity_factor * k / n`` stay in
  the residual and are counted as ``stats.overflow``).

  The calling convention is that of `exdyna`: ``init`` and ``update`` run per
  worker inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap(axis_name=)``,
  on the worker's local, unreduced gradient, first in an ``optax.chain``.

  Non-finite gradients are handled as in `exdyna`: if any worker's accumulated gradient
  holds a NaN or an infinity, every worker skips the step (zero update,
  state unchanged) and ``stats.nonfinite`` / ``stats.skipped_steps`` count it.

  Args:
    density: fraction of gradient elements to send per step, in ``(0, 1]``.
    axis_name: name of the data-parallel axis.
    capacity_factor: per-worker index buffer size as a multiple of ``k / n``.
    controller: ``"adaptive"`` (default) or ``"reference"`` (the published
      threshold rule, exactly).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    `ErrorFeedbackState` (partition starts and sizes counted in elements).

  References:
    Yoon & Oh, "MiCRO: Near-Zero Cost Gradient Sparsification for Scaling and
    Accelerating Distributed DNN Training", HiPC 2023, arXiv:2310.00967.
  """
  return _partitioned.partitioned_sparsifier(
      density,
      axis_name=axis_name,
      capacity_factor=capacity_factor,
      controller=controller,
      geometry_fn=_partition.element_geometry,
      rebalance=False,
  )
