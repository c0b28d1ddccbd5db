"""Independent NumPy model of the balanced partitioner (docs/algorithms.md, "Balanced partitions").

Written from the specification in plain loops and float64, to be compared
step by step with `exdyna_jax.exdyna` (``partitioner="balanced"``):

* Blocks hold ``s = ceil(N / B)`` elements; there are ``ceil(N / s)`` of
  them, the last one short.
* Cut at step ``t``: partition ``p`` is owned by worker ``(p - t) mod n``
  and gets the share ``(1 / scale_owner) / sum(1 / scale)`` of the
  cumulative block estimate; boundary ``p`` goes to the block boundary
  nearest its cumulative quantile (the lower one on a tie), then boundaries
  are pushed right, left to right, until each partition has at least one
  block, and capped so the later partitions still get one block each.
* Observe after step ``t``: a histogram of the transmitted indices by block
  (not a fallback index); each worker's overflow (passed minus sent) spread
  evenly over the blocks from its last transmitted index's block to its
  partition's end; both divided by the scale of the worker that owned the
  block. The scale of worker ``w`` moves by ``r * (log(passed_w + 1) -
  log(predicted_w + 1))`` in log space (``r = 0.3`` where that difference
  is positive, ``0.05`` otherwise); ``predicted_w`` is the total passed
  times worker ``w``'s share of ``sum(estimate * scale)`` over the
  partitions; then the log scales are centred. The block estimate becomes
  ``(1 - a) estimate + a (0.99 observed / sum(observed) + 0.01 length / N)``
  with ``a = max(1 / (t + 1), 0.1)`` (and stays when nothing was observed),
  renormalised to sum 1.
"""

from __future__ import annotations

import math

import numpy as np

SMOOTHING = 0.1
SCALE_RISE = 0.3
SCALE_FALL = 0.05
UNIFORM_PRIOR = 0.01


def block_layout(num_elements: int, num_blocks: int) -> tuple[int, int]:
  """``(block_size, blocks used)``."""
  size = math.ceil(num_elements / num_blocks)
  return size, math.ceil(num_elements / size)


def block_lengths(num_elements: int, block_size: int, num_blocks: int) -> np.ndarray:
  lengths = np.full(num_blocks, float(block_size))
  lengths[-1] = num_elements - (num_blocks - 1) * block_size
  return lengths


def cut(estimate: np.ndarray, scales: np.ndarray, step: int) -> np.ndarray:
  """Partition sizes in blocks for ``step``."""
  num_blocks, num_workers = len(estimate), len(scales)
  owners = [(p - step) % num_workers for p in range(num_workers)]
  shares = [1.0 / scales[w] for w in owners]
  cumulative = [0.0]
  for value in estimate:
    cumulative.append(cumulative[-1] + value)
  cumulative = [c / cumulative[-1] for c in cumulative]
  boundaries = [0]
  for p in range(1, num_workers):
    quantile = sum(shares[:p]) / sum(shares)
    above = next((j for j in range(num_blocks + 1) if cumulative[j] >= quantile), num_blocks)
    above = min(max(above, 1), num_blocks)
    below = above - 1
    wanted = below if quantile - cumulative[below] < cumulative[above] - quantile else above
    boundary = max(wanted, boundaries[-1] + 1, p)
    boundary = min(boundary, num_blocks - (num_workers - p))
    boundaries.append(boundary)
  boundaries.append(num_blocks)
  return np.diff(boundaries)


def observe(
    estimate: np.ndarray,
    scales: np.ndarray,
    *,
    sizes: np.ndarray,
    step: int,
    transmitted: list[list[int]],
    passed: list[int],
    num_elements: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
  """The estimate after a step.

  Args:
    estimate: ``[B]`` block estimate the step was cut from.
    scales: ``[n]`` worker scales.
    sizes: ``[n]`` partition sizes at the step.
    step: ``t``.
    transmitted: per worker, the indices it transmitted (no fallback index).
    passed: per worker, the elements that passed the threshold.
    num_elements: ``N``.
    block_size: ``s``.

  Returns:
    ``(estimate, scales)`` after the step.
  """
  num_blocks, num_workers = len(estimate), len(scales)
  ends = np.cumsum(sizes)
  starts = ends - sizes
  owner_of_block = np.zeros(num_blocks, int)
  for p in range(num_workers):
    owner_of_block[starts[p] : ends[p]] = (p - step) % num_workers

  observed = np.zeros(num_blocks)
  for w in range(num_workers):
    for index in transmitted[w]:
      observed[index // block_size] += 1
    overflow = passed[w] - len(transmitted[w])
    partition = (step + w) % num_workers
    first = (max(transmitted[w]) if transmitted[w] else 0) // block_size
    last = ends[partition]
    for block in range(first, last):
      observed[block] += overflow / max(last - first, 1)

  expected = np.zeros(num_workers)
  for block in range(num_blocks):
    w = owner_of_block[block]
    expected[w] += estimate[block] * scales[w]
  total = float(sum(passed))
  predicted = total * expected / sum(expected)
  surprise = np.log(np.asarray(passed, float) + 1) - np.log(predicted + 1)
  log_scales = np.log(scales) + np.where(surprise > 0, SCALE_RISE, SCALE_FALL) * surprise
  log_scales -= log_scales.mean()
  new_scales = np.exp(log_scales) if total > 0 else scales

  unscaled = observed / scales[owner_of_block]
  if unscaled.sum() > 0:
    prior = block_lengths(num_elements, block_size, num_blocks) / num_elements
    fresh = (1 - UNIFORM_PRIOR) * unscaled / unscaled.sum() + UNIFORM_PRIOR * prior
    weight = max(1.0 / (step + 1), SMOOTHING)
    estimate = (1 - weight) * estimate + weight * fresh
  return estimate / estimate.sum(), new_scales
