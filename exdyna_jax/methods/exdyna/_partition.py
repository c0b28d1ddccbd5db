"""Blocks, partitions, rotation, ExDyna's dynamic partition adjustment, and partitioners.

The flat vector of ``N`` elements is cut into ``num_blocks`` blocks of
``block_size`` elements (a multiple of 32); the ``remainder`` elements past the
last block always belong to the last partition. Partition ``p`` is the run of
``partition_sizes[p]`` blocks starting at block ``partition_starts[p]``.

A `Partitioner` says how a partitioned sparsifier lays its partitions out
and moves them: `REFERENCE` (the published layout and neighbour rule) and
`STATIC` (MiCRO: element partitions that never move) here, ``BALANCED`` in
`exdyna_jax.methods.exdyna._balance`.

References:
  Yoon & Oh, "Preserving Near-Optimal Gradient Sparsification Cost for
  Scalable Distributed Deep Learning" (ExDyna), CCGrid 2024,
  arXiv:2402.13781, section IV.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _integer

BLOCK_MULTIPLE = 32  # the published block size is a multiple of this
REFERENCE_NUM_BLOCKS = 1024  # the published B
IMBALANCE_HIGH = (105, 100)  # a partition is overloaded above 1.05 x mean
IMBALANCE_LOW = (95238, 100000)  # ... and underloaded below 0.95238 x mean


class BlockGeometry(NamedTuple):
  """Static block layout of a flat vector.

  Attributes:
    num_elements: ``N``.
    num_blocks: ``B``.
    block_size: ``s = floor(N / B) - floor(N / B) % 32``.
    remainder: ``N - B * s``, owned by the last partition.
    num_workers: ``n``.
  """

  num_elements: int
  num_blocks: int
  block_size: int
  remainder: int
  num_workers: int


def block_geometry(num_elements: int, num_blocks: int, num_workers: int) -> BlockGeometry:
  """Computes the block layout, with errors that name the fix.

  Args:
    num_elements: number of gradient elements ``N``.
    num_blocks: number of blocks ``B``.
    num_workers: number of workers ``n`` on the data-parallel axis.

  Returns:
    The `BlockGeometry`.

  Raises:
    ValueError: if ``B < 4 n`` (a partition could not keep its minimum of
      ``B / (4 n) >= 1`` blocks) or if ``N < 32 B`` (blocks would be empty).
  """
  if num_blocks < 4 * num_workers:
    raise ValueError(
        f"num_blocks={num_blocks} is too small for {num_workers} workers: every "
        f"partition keeps at least num_blocks / (4 * n) >= 1 blocks. Pass "
        f"num_blocks >= {4 * num_workers}."
    )
  per_block = num_elements // num_blocks
  block_size = per_block - per_block % BLOCK_MULTIPLE
  if block_size == 0:
    raise ValueError(
        f"The model has {num_elements} elements, too few for num_blocks={num_blocks}: "
        f"blocks hold a multiple of {BLOCK_MULTIPLE} elements, so at least "
        f"{BLOCK_MULTIPLE * num_blocks} elements are needed. Pass num_blocks <= "
        f"{max(num_elements // BLOCK_MULTIPLE, 1)}."
    )
  return BlockGeometry(
      num_elements=num_elements,
      num_blocks=num_blocks,
      block_size=block_size,
      remainder=num_elements - num_blocks * block_size,
      num_workers=num_workers,
  )


def element_geometry(num_elements: int, num_workers: int) -> BlockGeometry:
  """One block per element: partitions measured in elements (MiCRO).

  With ``block_size = 1``, ``num_blocks = N`` and no remainder, `initial_sizes`
  gives ``floor(N / n)`` elements per partition, one more for the first
  ``N mod n``, and `element_range` reads sizes and starts as element counts.

  Args:
    num_elements: number of gradient elements ``N``.
    num_workers: number of workers ``n`` on the data-parallel axis.

  Returns:
    The `BlockGeometry`.

  Raises:
    ValueError: if ``N < n`` (a partition would be empty).
  """
  if num_elements < num_workers:
    raise ValueError(
        f"The model has {num_elements} elements, fewer than the {num_workers} workers: "
        "every worker's partition needs at least one element."
    )
  return BlockGeometry(
      num_elements=num_elements,
      num_blocks=num_elements,
      block_size=1,
      remainder=0,
      num_workers=num_workers,
  )


def initial_sizes(num_blocks: int, num_workers: int) -> jax.Array:
  """``floor(B / n)`` blocks per partition, one more for the first ``B mod n``."""
  quotient, extra = divmod(num_blocks, num_workers)
  return jnp.asarray(
      [quotient + (p < extra) for p in range(num_workers)], dtype=jnp.int32
  )


def starts_of(sizes: jax.Array) -> jax.Array:
  """First block of every partition: the exclusive cumulative sum of sizes."""
  return jnp.cumsum(sizes) - sizes


def owned_partition(step: jax.Array, worker: jax.Array, num_workers: int) -> jax.Array:
  """Rotation: at step ``t`` worker ``w`` owns partition ``(t mod n + w) mod n``."""
  return (step % num_workers + worker) % num_workers


def by_partition(per_worker: jax.Array, step: jax.Array) -> jax.Array:
  """Re-indexes a per-worker array by the partition each worker owned at ``step``."""
  num_workers = per_worker.shape[0]
  workers = (jnp.arange(num_workers) - step % num_workers) % num_workers
  return per_worker[workers]


def element_range(
    geometry: BlockGeometry, starts: jax.Array, sizes: jax.Array, partition: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Half-open element range ``[begin, end)`` of ``partition``."""
  begin = starts[partition] * geometry.block_size
  end = (starts[partition] + sizes[partition]) * geometry.block_size
  end = end + jnp.where(partition == geometry.num_workers - 1, geometry.remainder, 0)
  return begin, end


def adjust(
    geometry: BlockGeometry, sizes: jax.Array, workloads: jax.Array
) -> jax.Array:
  """One left-to-right sweep of ExDyna's dynamic partition adjustment.

  For ``p = 0 .. n-2`` in order: if partition ``p`` is overloaded
  (``kappa_p / kbar > 1.05``) and ``p+1`` underloaded (``< 0.95238``), ``p``
  gives its last block to ``p+1``; symmetrically ``p+1`` gives its first block
  to ``p``. A partition never drops below ``B / (4 n)`` blocks. The workload
  estimates move with the block (``floor(s * K / N)`` elements), so a move can
  cascade along the sweep. With ``kbar = floor(K / n) == 0`` nothing moves.

  Args:
    geometry: the block layout.
    sizes: int32 ``[n]`` partition sizes in blocks.
    workloads: int32 ``[n]`` previous step's count per partition (``kappa``).

  Returns:
    The new int32 ``[n]`` sizes (the starts follow with `starts_of`).
  """
  num_workers = geometry.num_workers
  total = jnp.sum(workloads)
  mean = total // num_workers
  moved = _integer.floor_mul_div(total, geometry.block_size, geometry.num_elements)

  def can_give(size):
    return 4 * num_workers * (size - 1) >= geometry.num_blocks

  def overloaded(count):
    return _integer.exceeds_ratio(count, mean, *IMBALANCE_HIGH)

  def underloaded(count):
    return _integer.below_ratio(count, mean, *IMBALANCE_LOW)

  def sweep(p, carry):
    sizes, kappa = carry
    left, right = kappa[p], kappa[p + 1]
    to_right = overloaded(left) & underloaded(right) & can_give(sizes[p])
    to_left = underloaded(left) & overloaded(right) & can_give(sizes[p + 1])
    shift = to_right.astype(jnp.int32) - to_left.astype(jnp.int32)
    sizes = sizes.at[p].add(-shift).at[p + 1].add(shift)
    kappa = kappa.at[p].add(-shift * moved).at[p + 1].add(shift * moved)
    return sizes, kappa

  new_sizes, _ = jax.lax.fori_loop(0, num_workers - 1, sweep, (sizes, workloads))
  return jnp.where(mean > 0, new_sizes, sizes)


class PartitionEstimate(NamedTuple):
  """What a partitioner has learned from past steps (identical on every worker).

  Attributes:
    block_workloads: float32 ``[B]`` the balanced partitioner's smoothed
      share of the selections in each block (None for the others).
    worker_scales: float32 ``[n]`` its estimate of how much more each worker
      selects than the block estimate predicts (None for the others).
  """

  block_workloads: jax.Array | None
  worker_scales: jax.Array | None


class Partitioner(NamedTuple):
  """How a partitioned sparsifier lays out its partitions and moves them each step.

  Attributes:
    name: what ``exdyna(partitioner=...)`` calls it.
    geometry: ``(N, n, num_blocks or None) -> BlockGeometry``; raises a
      ``ValueError`` naming what to pass where the layout cannot fit.
    initial_estimate: ``geometry -> PartitionEstimate`` before the first step.
    cut: ``(estimate, geometry, sizes, workloads, step) -> sizes``: int32
      ``[n]`` blocks per partition for ``step``, from what the last step
      left (its sizes and per-partition workloads) and the estimate.
    observe: ``(estimate, geometry, *, sizes, step, gathered_indices, passed)
      -> PartitionEstimate``: the estimate updated with what the step
      selected (the exchanged index buffers and each worker's pass count).
  """

  name: str
  geometry: Callable[[int, int, int | None], BlockGeometry]
  initial_estimate: Callable[[BlockGeometry], PartitionEstimate]
  cut: Callable[..., jax.Array]
  observe: Callable[..., PartitionEstimate]


def learns_nothing(geometry: BlockGeometry) -> PartitionEstimate:
  """The estimate of a partitioner that keeps none: no arrays (orbax saves no empty one)."""
  del geometry
  return PartitionEstimate(None, None)


def keep_estimate(estimate: PartitionEstimate, geometry: BlockGeometry, **observed: Any
                  ) -> PartitionEstimate:
  """``observe`` of a partitioner that learns nothing."""
  del geometry, observed
  return estimate


def reference_geometry(num_elements: int, num_workers: int, num_blocks: int | None
                       ) -> BlockGeometry:
  """The published layout: `block_geometry` with ``B`` = 1024 unless given."""
  return block_geometry(
      num_elements, REFERENCE_NUM_BLOCKS if num_blocks is None else num_blocks, num_workers)


def published_cut(estimate: PartitionEstimate, geometry: BlockGeometry, sizes: jax.Array,
                  workloads: jax.Array, step: jax.Array) -> jax.Array:
  """The published rule: the first step keeps the initial sizes, later ones `adjust` them."""
  del estimate
  return jnp.where(step == 0, sizes, adjust(geometry, sizes, workloads))


def fixed_cut(estimate: PartitionEstimate, geometry: BlockGeometry, sizes: jax.Array,
              workloads: jax.Array, step: jax.Array) -> jax.Array:
  """Partitions that never move."""
  del estimate, geometry, workloads, step
  return sizes


REFERENCE = Partitioner("reference", reference_geometry, learns_nothing, published_cut,
                        keep_estimate)
STATIC = Partitioner("static", lambda num_elements, num_workers, _: element_geometry(
    num_elements, num_workers), learns_nothing, fixed_cut, keep_estimate)
