"""Validation of the options every sparsifier shares."""

from __future__ import annotations

import math


def check_density(density: float) -> float:
  """Returns ``density`` as a float, or raises naming the valid range."""
  if isinstance(density, bool) or not isinstance(density, (int, float)):
    raise TypeError(f"density must be a number in (0, 1], got {density!r}.")
  if not 0.0 < density <= 1.0:
    raise ValueError(
        f"density must be in (0, 1] (the fraction of gradient elements sent per "
        f"step, e.g. 0.001), got {density!r}."
    )
  return float(density)


def check_capacity_factor(capacity_factor: float) -> float:
  """Returns ``capacity_factor`` as a float, or raises if it is not positive."""
  if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
    raise TypeError(f"capacity_factor must be a positive number, got {capacity_factor!r}.")
  if not capacity_factor > 0:
    raise ValueError(
        f"capacity_factor must be > 0 (buffer slots per worker as a multiple of "
        f"k / n; 1.5 leaves room for 50 % imbalance), got {capacity_factor!r}."
    )
  return float(capacity_factor)


def target_count(density: float, num_elements: int) -> int:
  """``k = floor(density * N)``, which must be at least one element."""
  k = math.floor(density * num_elements)
  if k < 1:
    raise ValueError(
        f"density={density} selects floor(density * N) = 0 of the model's "
        f"{num_elements} elements. Pass density >= {1 / num_elements:.3g}."
    )
  return k


def capacity(capacity_factor: float, target: int, num_workers: int, num_elements: int) -> int:
  """Per-worker buffer slots ``C = ceil(capacity_factor * k / n)``, in ``[1, N]``."""
  return max(1, min(num_elements, math.ceil(capacity_factor * target / num_workers)))


VALUE_SLACK = 1.1  # values summed per step, as a multiple of k, where the controller holds k


def value_slots(target: int, capacity: int, num_workers: int) -> int:
  """Values summed per step when the indices are packed first: ``ceil(1.1 k)``, at most ``n C``.

  The threshold controller holds the indices transmitted at ``k``, so packing
  the gathered indices into ``1.1 k`` slots before the value ``psum`` loses
  almost nothing, whatever the imbalance between the workers' buffers.
  """
  return min(num_workers * capacity, math.ceil(VALUE_SLACK * target))


def check_threshold(threshold: float) -> float:
  """Returns ``threshold`` as a float, or raises if it is not positive and finite."""
  if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
    raise TypeError(f"threshold must be a positive number, got {threshold!r}.")
  if not 0.0 < threshold < math.inf:
    raise ValueError(
        f"threshold must be positive and finite (elements with |a| >= threshold "
        f"are sent), got {threshold!r}."
    )
  return float(threshold)


def check_capacity(capacity: int) -> int:
  """Returns ``capacity`` (index slots per worker), or raises if not a positive int."""
  if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
    raise ValueError(f"capacity must be a positive int (index slots per worker), got {capacity!r}.")
  return capacity
