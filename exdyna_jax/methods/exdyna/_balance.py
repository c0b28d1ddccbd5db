"""Balanced partitions: re-cut every step from a measured block-workload estimate.

ExDyna's published rule (`exdyna_jax.methods.exdyna._partition.adjust`) moves at most one
block across each partition boundary per step, and only between an
overloaded and an underloaded neighbour; on uneven models it stalls, and the
fullest index buffer overflows. The balanced partitioner re-cuts *all*
boundaries in one step instead, from two estimates kept in the optimizer
state and updated from what every worker already holds after the exchange
(the all-gathered index buffers and the counts riding on them), so it costs
no extra traffic:

- ``block_workloads``: the share of the selections that falls in each block,
  smoothed over steps. Each step's observation is the per-block histogram of
  the transmitted indices, plus each worker's overflow (elements that passed
  but were not sent) spread over the blocks past its last transmitted index
  (a worker sends its lowest indices, so the overflow lies there), divided
  by the scale of the worker that selected there.
- ``worker_scales``: how much more each worker selects than the estimate
  predicts for its partition (geometric mean 1). Workers whose gradients are
  larger select more wherever they are; since partition ``p`` goes to worker
  ``(p - t) mod n`` at step ``t``, each partition is sized for the worker
  that will own it. A scale rises fast and falls slowly: a worker whose
  batch gave a large gradient keeps it in its residual and selects several
  times its share in every partition it visits for about one sweep, and
  underestimating a scale overflows that worker's buffer, while
  overestimating it only shifts selections to the other workers.

At the start of step ``t`` partition ``p`` gets the blocks around the
quantiles of the cumulative estimate that give its owner an expected
``k / n`` selections, with at least one block. Partitions of any length are
allowed: the selection reads its partition chunk by chunk
(`exdyna_jax.selection._selection.select_in_range`), so its cost follows the
partition's length, and the lengths add up to ``N``.

Blocks: ``s = ceil(N / B)`` elements each, the last one shorter, so no large
remainder is left to the last partition (the published layout leaves up to
``32 B`` elements there).

The constants below were chosen on the benchmark workloads of
``benchmarks/density_control.py``: a faster or slower smoothing, or scales
moving fast both ways, left a larger imbalance; scales rising as slowly as
they fall (0.05) left up to 1.4 % of ``k`` overflowing on the 1-D CNN (8
workers) and 2.5 % with heterogeneous workers (16).

References:
  Yoon & Oh, ExDyna, CCGrid 2024, arXiv:2402.13781 (the partitions and
  their rotation); Shi et al., Ok-Topk, PPoPP 2022 (re-partitioning from
  quantiles, there every 64 iterations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from exdyna_jax.methods.exdyna import _partition

BLOCKS_PER_WORKER = 1024  # default: at most this many blocks per worker ...
MIN_BLOCK_ELEMENTS = 32  # ... of at least this many elements (one row)
SMOOTHING = 0.1  # weight of the newest observation in block_workloads, once warm
SCALE_RISE = 0.3  # step of log(worker_scales) towards an observation above it ...
SCALE_FALL = 0.05  # ... and towards one below it
UNIFORM_PRIOR = 0.01  # share of block_workloads kept proportional to block length


def default_num_blocks(num_elements: int, num_workers: int) -> int:
  """``B`` when the user gives none: fine enough to balance, coarse enough to be free.

  ``BLOCKS_PER_WORKER`` blocks per worker of at least ``MIN_BLOCK_ELEMENTS``
  elements, but at least two blocks per worker while ``N`` allows.

  Args:
    num_elements: ``N``.
    num_workers: ``n``.

  Returns:
    The requested number of blocks (the layout may use fewer, see
    `balanced_geometry`).
  """
  wanted = min(-(-num_elements // MIN_BLOCK_ELEMENTS), BLOCKS_PER_WORKER * num_workers)
  return min(num_elements, max(2 * num_workers, wanted))


def balanced_geometry(
    num_elements: int, num_workers: int, num_blocks: int | None = None
) -> _partition.BlockGeometry:
  """Blocks of ``ceil(N / B)`` elements, the last one shorter.

  Args:
    num_elements: ``N``.
    num_workers: ``n``.
    num_blocks: requested ``B``, or None for `default_num_blocks`.

  Returns:
    The `BlockGeometry` (its ``remainder`` is ``N - B s <= 0``: the last
    block is short by that much).

  Raises:
    ValueError: if ``N < n`` or ``B`` is outside ``[n, N]``, naming what
      to pass.
  """
  if num_elements < num_workers:
    raise ValueError(
        f"The model has {num_elements} elements, fewer than the {num_workers} workers: "
        "every worker's partition needs at least one element."
    )
  if num_blocks is None:
    num_blocks = default_num_blocks(num_elements, num_workers)
  if not num_workers <= num_blocks <= num_elements:
    raise ValueError(
        f"num_blocks={num_blocks} does not fit {num_elements} elements and {num_workers} "
        f"workers: every partition needs a block and every block an element. Pass "
        f"num_blocks between {num_workers} and {num_elements}, or leave it None (default: "
        f"{default_num_blocks(num_elements, num_workers)} here)."
    )
  block_size = -(-num_elements // num_blocks)
  used = -(-num_elements // block_size)
  if used < num_workers:  # ceil rounding can leave fewer blocks than asked
    block_size = num_elements // num_workers
    used = -(-num_elements // block_size)
  return _partition.BlockGeometry(
      num_elements=num_elements,
      num_blocks=used,
      block_size=block_size,
      remainder=num_elements - used * block_size,
      num_workers=num_workers,
  )


def block_lengths(geometry: _partition.BlockGeometry) -> jax.Array:
  """float32 ``[B]`` elements per block (the last one short)."""
  lengths = jnp.full((geometry.num_blocks,), geometry.block_size, jnp.float32)
  return lengths.at[-1].add(geometry.remainder)


def initial_estimate(geometry: _partition.BlockGeometry) -> _partition.PartitionEstimate:
  """Selections spread evenly over the elements; every worker of scale 1."""
  return _partition.PartitionEstimate(
      block_workloads=block_lengths(geometry) / geometry.num_elements,
      worker_scales=jnp.ones((geometry.num_workers,), jnp.float32),
  )


def _block_owners(boundaries: jax.Array, num_blocks: int) -> jax.Array:
  """int32 ``[B]`` partition of every block, for block boundaries ``[n + 1]``."""
  inner = boundaries[1:-1]
  blocks = jnp.arange(num_blocks, dtype=jnp.int32)
  return jnp.searchsorted(inner, blocks, side="right", method="scan_unrolled").astype(jnp.int32)


def _boundaries(sizes: jax.Array) -> jax.Array:
  """int32 ``[n + 1]`` block boundaries ``0, e_1, ..., B`` of partitions of ``sizes``."""
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])


def cut(
    estimate: _partition.PartitionEstimate,
    geometry: _partition.BlockGeometry,
    sizes: jax.Array,
    workloads: jax.Array,
    step: jax.Array,
) -> jax.Array:
  """Partition sizes for ``step``: equal expected selections for each partition's owner.

  Partition ``p`` is owned by worker ``(p - t) mod n`` at step ``t`` and is
  given ``1 / scale`` of that worker's share of the cumulative
  ``block_workloads``; each boundary goes to the block boundary nearest its
  quantile, then they are moved apart just enough that every partition
  keeps at least one block.

  Args:
    estimate: the `_partition.PartitionEstimate`.
    geometry: the block layout.
    sizes: the last step's sizes (unused: the cut reads only the estimate).
    workloads: the last step's workloads (unused, as ``sizes``).
    step: int32 the step the partitions are for.

  Returns:
    int32 ``[n]`` blocks per partition (sum ``B``).
  """
  del sizes, workloads
  num_workers, num_blocks = geometry.num_workers, geometry.num_blocks
  owners = (jnp.arange(num_workers) - step) % num_workers
  share = 1.0 / estimate.worker_scales[owners]
  quantiles = jnp.cumsum(share)[:-1] / jnp.sum(share)
  cumulative = jnp.concatenate(
      [jnp.zeros((1,), jnp.float32), jnp.cumsum(estimate.block_workloads)]
  )
  cumulative = cumulative / cumulative[-1]
  above = jnp.clip(jnp.searchsorted(cumulative, quantiles, method="scan_unrolled"), 1, num_blocks)
  nearer_below = quantiles - cumulative[above - 1] < cumulative[above] - quantiles
  wanted = jnp.where(nearer_below, above - 1, above).astype(jnp.int32)

  # Every partition keeps at least one block: boundary p lies in [p, B - n + p]
  # and above boundary p - 1, so boundary - p is non-decreasing.
  shifted = jax.lax.cummax(wanted - jnp.arange(1, num_workers, dtype=jnp.int32))
  inner = jnp.clip(shifted, 0, num_blocks - num_workers) + jnp.arange(1, num_workers)
  boundaries = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), inner.astype(jnp.int32), jnp.full((1,), num_blocks, jnp.int32)]
  )
  return jnp.diff(boundaries).astype(jnp.int32)


def observe(
    estimate: _partition.PartitionEstimate,
    geometry: _partition.BlockGeometry,
    *,
    sizes: jax.Array,
    step: jax.Array,
    gathered_indices: jax.Array,
    passed: jax.Array,
) -> _partition.PartitionEstimate:
  """Updates the estimate with what step ``t`` selected (the same on every worker).

  Args:
    estimate: the `_partition.PartitionEstimate` the step's partitions were cut from.
    geometry: the block layout.
    sizes: int32 ``[n]`` blocks per partition at the step.
    step: int32 ``t``.
    gathered_indices: int32 ``[n, C]`` the indices every worker sent
      (sentinel ``N``), row ``w`` from worker ``w``.
    passed: int32 ``[n]`` elements that passed the threshold on each worker,
      before the capacity limit (0 when only the fallback index was sent).

  Returns:
    The new `_partition.PartitionEstimate`.
  """
  num_workers, num_blocks = geometry.num_workers, geometry.num_blocks
  num_elements = geometry.num_elements
  boundaries = _boundaries(sizes)
  partition_of_worker = (step + jnp.arange(num_workers)) % num_workers
  worker_of_partition = (jnp.arange(num_workers) - step) % num_workers

  # Transmitted indices per block (a fallback index carries no workload).
  real = (gathered_indices < num_elements) & (passed > 0)[:, None]
  blocks = jnp.where(real, gathered_indices // geometry.block_size, num_blocks)
  histogram = jnp.zeros((num_blocks,), jnp.float32).at[blocks.reshape(-1)].add(1.0, mode="drop")

  # Overflow lies past each worker's last transmitted index: spread it there.
  overflow = (passed - jnp.sum(real, axis=1)).astype(jnp.float32)
  last = jnp.max(jnp.where(real, gathered_indices, -1), axis=1)
  first_block = jnp.maximum(last, 0) // geometry.block_size
  end_block = boundaries[partition_of_worker + 1]
  per_block = overflow / jnp.maximum(end_block - first_block, 1).astype(jnp.float32)
  spread = (
      jnp.zeros((num_blocks + 1,), jnp.float32)
      .at[first_block].add(per_block)
      .at[end_block].add(-per_block)
  )
  observed = histogram + jnp.cumsum(spread)[:num_blocks]

  # Worker scales: observed against predicted share of each worker's partition.
  owners = worker_of_partition[_block_owners(boundaries, num_blocks)]
  expected = jax.ops.segment_sum(
      estimate.block_workloads * estimate.worker_scales[owners], owners, num_workers
  )
  total = jnp.sum(passed).astype(jnp.float32)
  predicted = total * expected / jnp.maximum(jnp.sum(expected), 1e-30)
  surprise = jnp.log(passed.astype(jnp.float32) + 1.0) - jnp.log(predicted + 1.0)
  rate = jnp.where(surprise > 0, SCALE_RISE, SCALE_FALL)
  log_scales = jnp.log(estimate.worker_scales) + rate * surprise
  log_scales = log_scales - jnp.mean(log_scales)

  # Block workloads for a worker of scale 1, smoothed (a running mean at first).
  unscaled = observed / estimate.worker_scales[owners]
  observed_total = jnp.sum(unscaled)
  prior = block_lengths(geometry) / num_elements
  share = unscaled / jnp.maximum(observed_total, 1e-30)
  fresh = (1 - UNIFORM_PRIOR) * share + UNIFORM_PRIOR * prior
  weight = jnp.maximum(1.0 / (step.astype(jnp.float32) + 1.0), SMOOTHING)
  weight = jnp.where(observed_total > 0, weight, 0.0)
  workloads = (1 - weight) * estimate.block_workloads + weight * fresh
  return _partition.PartitionEstimate(
      block_workloads=workloads / jnp.sum(workloads),
      worker_scales=jnp.exp(jnp.where(total > 0, log_scales, jnp.log(estimate.worker_scales))),
  )


BALANCED = _partition.Partitioner("balanced", balanced_geometry, initial_estimate, cut, observe)
