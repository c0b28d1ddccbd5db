"""Validation of the options every sparsifier shares, and the buffer sizes they give."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import jax
import numpy as np


def _static_scalar(value, name: str, kind: type) -> float | int:
  """``value`` as a Python number of ``kind`` (``numbers.Real`` or ``Integral``).

  Python, NumPy and concrete JAX scalars are accepted; ``bool`` and traced
  values are not (the option fixes buffer shapes, so it must be known when
  the step is traced).
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a concrete number: it sets the static buffer sizes, so it cannot "
        f"be traced. With optax.inject_hyperparams pass static_args=({name!r}, ...) for "
        "every option of the sparsifier."
    )
  if isinstance(value, (np.ndarray, jax.Array)) and value.shape == ():
    value = value.item()
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, kind):
    expected = "an int" if kind is numbers.Integral else "a number"
    raise TypeError(f"{name} must be {expected}, got {value!r}.")
  return int(value) if kind is numbers.Integral else float(value)


def _check(value, name: str, kind: type, valid: Callable[[float], bool], rule: str):
  """``value`` as a Python number of ``kind`` if ``valid``, else a ValueError stating ``rule``."""
  value = _static_scalar(value, name, kind)
  if not valid(value):
    raise ValueError(f"{name} must be {rule}, got {value!r}.")
  return value


def check_density(density: float) -> float:
  """Returns ``density`` as a float, or raises naming the valid range."""
  return _check(
      density, "density", numbers.Real, lambda d: 0.0 < d <= 1.0,
      "in (0, 1] (the fraction of gradient elements sent per step, e.g. 0.001)",
  )


def check_positive_finite(value: float, name: str, meaning: str) -> float:
  """Returns ``value`` as a float, or raises if it is not positive and finite."""
  return _check(value, name, numbers.Real, lambda v: 0.0 < v < math.inf,
                f"positive and finite ({meaning})")


def check_capacity_factor(capacity_factor: float) -> float:
  """Returns ``capacity_factor`` (slots per worker over ``k / n``) checked."""
  return check_positive_finite(
      capacity_factor, "capacity_factor",
      "buffer slots per worker as a multiple of k / n; 1.5 leaves room for 50 % imbalance; "
      "slots past N are never used, so a large factor is capped there",
  )


def check_flag(value, name: str, meaning: str, *, optional: bool = False) -> bool | None:
  """Returns ``value`` if it is a bool (or None, if ``optional``), or raises a
  TypeError that says what it switches."""
  if optional and value is None:
    return None
  if not isinstance(value, (bool, np.bool_)):
    choices = "True, False or None" if optional else "True or False"
    raise TypeError(f"{name} must be {choices} ({meaning}), got {value!r}.")
  return bool(value)


def check_num_blocks(num_blocks: int | None) -> int | None:
  """Returns ``num_blocks`` as an int (or None), or raises if it is not a positive int."""
  if num_blocks is None:
    return None
  return check_positive_int(num_blocks, "num_blocks", "or None for the default")


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


# Default index slots per worker, C = (BURST + NOISE / sqrt(k / n)) k / n: a
# partition's count swings by about +-35 % from step to step even when its
# expected share is exact (layer-wise gradient bursts, measured on MLPs and a
# transformer), plus counting noise of sqrt(k / n). This keeps overflow
# within 1 % of k on the benchmark models (benchmarks/density_control.py).
CAPACITY_BURST = 2.3
CAPACITY_NOISE = 4.0
REFERENCE_CAPACITY_FACTOR = 1.5  # with the published exchange (every slot's value summed)


def default_capacity_factor(target: int, num_workers: int, controller: str) -> float:
  """``capacity_factor`` when the user gives none.

  Args:
    target: ``k``.
    num_workers: ``n``.
    controller: the threshold controller's name.

  Returns:
    ``CAPACITY_BURST + CAPACITY_NOISE / sqrt(k / n)`` for the adaptive
    controller, ``REFERENCE_CAPACITY_FACTOR`` for the reference one.
  """
  if controller == "reference":
    return REFERENCE_CAPACITY_FACTOR
  return CAPACITY_BURST + CAPACITY_NOISE / math.sqrt(target / num_workers)


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
  return check_positive_finite(threshold, "threshold", "elements with |a| >= threshold are sent")


def check_positive_int(value: int, name: str, meaning: str = "") -> int:
  """Returns ``value`` as an int, or raises if it is not a positive int (``meaning`` explains)."""
  return _check(value, name, numbers.Integral, lambda v: v >= 1,
                f"a positive int{f' ({meaning})' if meaning else ''}")


def check_capacity(capacity: int) -> int:
  """Returns ``capacity`` (index slots per worker), or raises if not a positive int."""
  return check_positive_int(capacity, "capacity", "index slots per worker")


VALUE_DTYPES = ("float32", "bfloat16", "float16")


def check_value_dtype(value_dtype) -> np.dtype:
  """``value_dtype`` as a dtype (float32, bfloat16 or float16), or raises listing them."""
  try:
    dtype = jax.numpy.dtype(value_dtype)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in VALUE_DTYPES:
    raise ValueError(
        f"value_dtype must be one of {', '.join(VALUE_DTYPES)} (the dtype the exchanged "
        f"values are summed in), got {value_dtype!r}."
    )
  return dtype
