"""Independent NumPy model of published ExDyna, written from docs/algorithms.md.

This model is deliberately written without looking at the JAX implementation:
it is the executable form of the specification that the ``controller="reference"``
mode of `exdyna_jax.exdyna` is checked against, step by step.

Conventions (the ones the reference mode pins down):

* The flat vector is the concatenation of ``jax.tree.leaves`` in order; the
  accumulated gradient is ``a_w = float32(g_w) + m_w`` in float32.
* The threshold is a float32 scalar, ``float32(1 / (2 sqrt(k)))`` at the start
  (computed in float64), then multiplied each step by a float32 factor in
  float32 arithmetic. Selection is ``|a_w| >= threshold`` in float32.
* Threshold bands on ``e = K / k`` and partition-adjustment ratios use the
  released code's literals (1.1, 0.909, 1.05, 0.95238) as exact rational
  comparisons in integers; the moved workload estimate is ``(s * K) // N``.
* A partition's workload ``kappa`` counts the indices its worker sent: the
  elements passing the threshold, or 1 when nothing passed and the fallback
  index was sent.
* Each worker's index buffer holds ``C`` indices; when more pass, the ``C``
  lowest indices are sent and the rest stay in the residual (overflow). The
  threshold rule and the adjustment see the true, pre-capacity counts.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# The released code's threshold factors, applied in float32.
THRESHOLD_UP_FACTOR = np.float32(1.005)
THRESHOLD_CREEP_FACTOR = np.float32(1.00125)
THRESHOLD_DOWN_FACTOR = np.float32(0.995)


def threshold_factor(selected: int, target: int) -> np.float32:
  """Multiplicative threshold update for ``e = selected / target``.

  ``e > 1.1`` -> 1.005; ``0.909 < e <= 1.1`` -> 1.00125 (the released code's
  unreachable downward nudge is not modelled: inside the band the threshold
  always creeps up); ``e <= 0.909`` -> 0.995.
  """
  if 10 * selected > 11 * target:
    return THRESHOLD_UP_FACTOR
  if 1000 * selected > 909 * target:
    return THRESHOLD_CREEP_FACTOR
  return THRESHOLD_DOWN_FACTOR


def is_overloaded(workload: int, mean_workload: int) -> bool:
  """``workload / mean_workload > 1.05``, exactly."""
  return 20 * workload > 21 * mean_workload


def is_underloaded(workload: int, mean_workload: int) -> bool:
  """``workload / mean_workload < 0.95238``, exactly."""
  return 100000 * workload < 95238 * mean_workload


@dataclasses.dataclass(frozen=True)
class BlockGeometry:
  """How the flat vector is cut into blocks.

  Attributes:
    num_elements: ``N``, flat gradient length.
    num_blocks: ``B``.
    block_size: ``s``, elements per block (a multiple of 32).
    num_workers: ``n``.
  """

  num_elements: int
  num_blocks: int
  block_size: int
  num_workers: int

  @classmethod
  def create(cls, num_elements: int, num_blocks: int, num_workers: int) -> BlockGeometry:
    """Geometry with ``s = floor(N/B) - floor(N/B) % 32``."""
    per_block = num_elements // num_blocks
    block_size = per_block - per_block % 32
    if block_size < 32:
      raise ValueError(f"N={num_elements} is too small for B={num_blocks} blocks.")
    if num_blocks < 4 * num_workers:
      raise ValueError(f"B={num_blocks} must be at least 4n={4 * num_workers}.")
    return cls(num_elements, num_blocks, block_size, num_workers)

  def initial_sizes(self) -> np.ndarray:
    """``floor(B/n)`` blocks each, one more for the first ``B mod n``."""
    n = self.num_workers
    sizes = np.full(n, self.num_blocks // n, np.int64)
    sizes[: self.num_blocks % n] += 1
    return sizes

  def can_give_block(self, size: int) -> bool:
    """A partition keeps at least ``C_min = B / (4n)`` blocks."""
    return 4 * self.num_workers * (size - 1) >= self.num_blocks

  def element_range(self, partition: int, starts: np.ndarray, sizes: np.ndarray) -> tuple[int, int]:
    """``[begin, end)`` of a partition; the last one also owns the remainder."""
    begin = int(starts[partition]) * self.block_size
    if partition == self.num_workers - 1:
      end = self.num_elements
    else:
      end = int(starts[partition] + sizes[partition]) * self.block_size
    return begin, end


def adjust_partitions(
    geometry: BlockGeometry,
    starts: np.ndarray,
    sizes: np.ndarray,
    workloads: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int]:
  """One left-to-right sweep of the dynamic partition adjustment.

  Args:
    geometry: the block geometry.
    starts: first block of each partition, ``[n]``.
    sizes: blocks per partition, ``[n]``.
    workloads: ``kappa_p`` of the previous step, ``[n]``.

  Returns:
    New starts, new sizes and the number of blocks moved.
  """
  n = geometry.num_workers
  starts = starts.astype(np.int64).copy()
  sizes = sizes.astype(np.int64).copy()
  kappa = [int(x) for x in workloads]
  total = sum(kappa)
  mean_workload = total // n
  if mean_workload == 0:
    return starts, sizes, 0
  moved_estimate = (geometry.block_size * total) // geometry.num_elements
  moves = 0
  for p in range(n - 1):
    left, right = kappa[p], kappa[p + 1]
    if (
        is_overloaded(left, mean_workload)
        and is_underloaded(right, mean_workload)
        and geometry.can_give_block(int(sizes[p]))
    ):
      # p gives its last block to p + 1.
      sizes[p] -= 1
      sizes[p + 1] += 1
      starts[p + 1] -= 1
      kappa[p] -= moved_estimate
      kappa[p + 1] += moved_estimate
      moves += 1
    elif (
        is_underloaded(left, mean_workload)
        and is_overloaded(right, mean_workload)
        and geometry.can_give_block(int(sizes[p + 1]))
    ):
      # p + 1 gives its first block to p.
      sizes[p] += 1
      sizes[p + 1] -= 1
      starts[p + 1] += 1
      kappa[p] += moved_estimate
      kappa[p + 1] -= moved_estimate
      moves += 1
  return starts, sizes, moves


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """Everything one model step did, in the implementation's terms.

  Attributes:
    step: completed steps after this one (``t + 1``).
    threshold: float32 threshold used at this step.
    partition_starts: ``[n]`` first block of each partition used at this step.
    partition_sizes: ``[n]`` blocks per partition used at this step.
    workloads: ``[n]`` kappa per partition (indices sent, pre-capacity).
    selected: ``K`` of this step.
    transmitted: indices actually exchanged.
    overflow: ``selected - transmitted``.
    fallback_partitions: partitions whose worker sent the fallback index
      (nothing passed the threshold there).
    blocks_moved: partition-boundary moves made before this step's selection.
    transmitted_indices: sorted flat indices exchanged.
    update: float64 ``[N]`` exact mean of the accumulated gradients at the
      transmitted indices, zero elsewhere.
    update_scale: float64 ``[N]`` mean of ``|a_w|`` over workers, the scale
      for the rounding of a float32 cross-worker sum.
    residuals: float32 ``[n, N]`` residuals after this step.
  """

  step: int
  threshold: np.float32
  partition_starts: np.ndarray
  partition_sizes: np.ndarray
  workloads: np.ndarray
  selected: int
  transmitted: int
  overflow: int
  fallback_partitions: tuple[int, ...]
  blocks_moved: int
  transmitted_indices: np.ndarray
  update: np.ndarray
  update_scale: np.ndarray
  residuals: np.ndarray


def capacity_of(capacity_factor: float, target: int, num_workers: int, num_elements: int) -> int:
  """``ceil(capacity_factor * k / n)`` clamped to ``[1, N]``."""
  return int(min(max(math.ceil(capacity_factor * target / num_workers), 1), num_elements))


class ExDynaModel:
  """ExDyna with error feedback over ``n`` simulated workers, in NumPy.

  Attributes:
    geometry: the block geometry.
    target: ``k = floor(d * N)``.
    capacity: per-worker index buffer size ``C``.
    threshold: float32 threshold the next step will use (before its update).
    starts: current partition starts (blocks).
    sizes: current partition sizes (blocks).
    residuals: float32 ``[n, N]``.
    step_count: completed steps.
  """

  def __init__(
      self,
      num_elements: int,
      num_workers: int,
      density: float,
      num_blocks: int,
      capacity_factor: float,
  ):
    self.geometry = BlockGeometry.create(num_elements, num_blocks, num_workers)
    self.target = math.floor(density * num_elements)
    if self.target < 1:
      raise ValueError("density * N must be at least 1.")
    self.capacity = capacity_of(capacity_factor, self.target, num_workers, num_elements)
    self.threshold = np.float32(1.0 / (2.0 * math.sqrt(self.target)))
    self.sizes = self.geometry.initial_sizes()
    self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
    self.residuals = np.zeros((num_workers, num_elements), np.float32)
    self.step_count = 0
    self._last_workloads: np.ndarray | None = None
    self._last_selected = 0

  def step(self, local_grads: np.ndarray) -> StepRecord:
    """Runs one step.

    Args:
      local_grads: ``[n, N]`` flat local gradients, one row per worker.

    Returns:
      The record of this step.
    """
    geometry = self.geometry
    n, num_elements = geometry.num_workers, geometry.num_elements
    t = self.step_count
    if local_grads.shape != (n, num_elements):
      raise ValueError(f"expected [{n}, {num_elements}], got {local_grads.shape}")

    blocks_moved = 0
    if t >= 1:
      self.threshold = np.float32(
          self.threshold * threshold_factor(self._last_selected, self.target)
      )
      self.starts, self.sizes, blocks_moved = adjust_partitions(
          geometry, self.starts, self.sizes, self._last_workloads
      )
    assert self.starts[0] == 0 and int(self.sizes.sum()) == geometry.num_blocks
    assert np.array_equal(self.starts[1:], np.cumsum(self.sizes)[:-1])

    accumulated = local_grads.astype(np.float32) + self.residuals
    workloads = np.zeros(n, np.int64)
    transmitted_parts = []
    fallback_partitions = []
    for worker in range(n):
      partition = (t % n + worker) % n
      begin, end = geometry.element_range(partition, self.starts, self.sizes)
      passing = begin + np.flatnonzero(np.abs(accumulated[worker, begin:end]) >= self.threshold)
      if passing.size == 0:
        passing = np.array([begin + t % (end - begin)], np.int64)
        fallback_partitions.append(partition)
      workloads[partition] = passing.size
      transmitted_parts.append(passing[: self.capacity])  # ascending: C lowest indices.

    transmitted_indices = np.sort(np.concatenate(transmitted_parts))
    assert np.unique(transmitted_indices).size == transmitted_indices.size
    selected = int(workloads.sum())

    update = np.zeros(num_elements, np.float64)
    update[transmitted_indices] = (
        accumulated[:, transmitted_indices].astype(np.float64).sum(axis=0) / n
    )
    update_scale = np.abs(accumulated).astype(np.float64).mean(axis=0)
    residuals = accumulated.copy()
    residuals[:, transmitted_indices] = 0.0

    record = StepRecord(
        step=t + 1,
        threshold=self.threshold,
        partition_starts=self.starts.copy(),
        partition_sizes=self.sizes.copy(),
        workloads=workloads,
        selected=selected,
        transmitted=int(transmitted_indices.size),
        overflow=selected - int(transmitted_indices.size),
        fallback_partitions=tuple(sorted(fallback_partitions)),
        blocks_moved=blocks_moved,
        transmitted_indices=transmitted_indices,
        update=update,
        update_scale=update_scale,
        residuals=residuals,
    )
    self.residuals = residuals
    self._last_workloads = workloads
    self._last_selected = selected
    self.step_count = t + 1
    return record

  def run(self, local_grads: np.ndarray) -> list[StepRecord]:
    """Runs ``[n, steps, N]`` flat local gradients; returns one record per step."""
    return [self.step(local_grads[:, t]) for t in range(local_grads.shape[1])]
