"""Online control of the global selection threshold.

Two controllers share one interface. Each step the sparsifier selects
``|a| >= threshold`` and also counts, in the same pass, how many elements pass
the *probe* thresholds ``threshold * probe_ratios``; those counts ride on the
index all-gather that happens anyway, so every worker sees the global counts
without an extra collective round. Before the next step the controller turns
them into the next threshold.

- ``"reference"`` is the published ExDyna/MiCRO rule, exactly: start at
  ``1 / (2 sqrt(k))`` and scale by ``x1.005`` when ``K/k > 1.1``, by
  ``x1.00125`` when ``0.909 < K/k <= 1.1`` (the released code's downward nudge
  in that band can never trigger) and by ``x0.995`` otherwise. It uses no
  probes.
- ``"adaptive"`` (default) inverts the measured count curve: the global
  counts at the probe thresholds give ``log K`` against ``log threshold``
  piecewise linearly, and the next threshold is where that curve meets
  ``k / drift``, ``drift`` being a running estimate of how much the count at a
  fixed threshold changed from one step to the next (error feedback makes the
  accumulated gradient grow where nothing is sent).

References:
  Yoon & Oh, ExDyna, CCGrid 2024, arXiv:2402.13781, section IV-C.
  Sahu et al., "Rethinking gradient sparsification as total error
  minimization", NeurIPS 2021 (the initial threshold).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax import _integer

# Published rule: (numerator, denominator) of the band edges, and the factors.
REFERENCE_UPPER = (11, 10)
REFERENCE_LOWER = (909, 1000)
REFERENCE_FACTORS = (1.005, 1.00125, 0.995)

ADAPTIVE_PROBE_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
ADAPTIVE_DRIFT_SMOOTHING = 0.5  # weight of the newest drift observation
ADAPTIVE_MAX_MOVE = 4.0  # never move further than this beyond the probe grid
ADAPTIVE_SLOPE_RANGE = (-20.0, -0.1)  # d log K / d log threshold, clamped


class ControllerState(NamedTuple):
  """Memory of a threshold controller between steps.

  Attributes:
    probe_counts: int32 ``[P]`` global counts at the previous step's probe
      thresholds (``P = 0`` for the reference rule).
    log_drift: float32 running estimate of ``log(K_t / K_{t-1})`` at a fixed
      threshold (adaptive only).
    predicted: float32 count the adaptive rule predicted for the previous
      step, or ``-1`` when it made no prediction.
  """

  probe_counts: jax.Array
  log_drift: jax.Array
  predicted: jax.Array


class ThresholdController(NamedTuple):
  """A threshold rule as a pair of pure functions.

  Attributes:
    name: ``"reference"`` or ``"adaptive"``.
    probe_ratios: static multipliers of the threshold whose global counts the
      controller needs from every step.
    initial_threshold: ``k -> threshold`` for step 0.
    next_threshold: ``(threshold, state, selected, target) -> (threshold,
      state)``, where ``selected`` is the previous step's global count ``K``.
  """

  name: str
  probe_ratios: tuple[float, ...]
  initial_threshold: Callable[[int], float]
  next_threshold: Callable[..., tuple[jax.Array, ControllerState]]

  def init(self) -> ControllerState:
    return ControllerState(
        probe_counts=jnp.zeros((len(self.probe_ratios),), jnp.int32),
        log_drift=jnp.zeros((), jnp.float32),
        predicted=jnp.full((), -1.0, jnp.float32),
    )


def hard_threshold_rule(target: int) -> float:
  """``1 / (2 sqrt(k))``: the hard-threshold rule of Sahu et al."""
  return 1.0 / (2.0 * math.sqrt(target))


def _reference_next(threshold, state, selected, target):
  factor = jnp.where(
      _integer.exceeds_ratio(selected, jnp.int32(target), *REFERENCE_UPPER),
      REFERENCE_FACTORS[0],
      jnp.where(
          _integer.exceeds_ratio(selected, jnp.int32(target), *REFERENCE_LOWER),
          REFERENCE_FACTORS[1],
          REFERENCE_FACTORS[2],
      ),
  ).astype(jnp.float32)
  return threshold * factor, state


def _count_curve(log_thresholds, counts):
  """Piecewise-linear ``log K(log threshold)`` through the probes.

  Returns per-segment ``(x0, y0, slope)``: ``len(probes) - 1`` segments, the
  first and last also used for extrapolation.
  """
  log_counts = jnp.log(jnp.maximum(counts.astype(jnp.float32), 0.5))
  slopes = jnp.diff(log_counts) / jnp.diff(log_thresholds)
  slopes = jnp.clip(slopes, *ADAPTIVE_SLOPE_RANGE)
  return log_thresholds[:-1], log_counts[:-1], slopes


def _segment_of(log_counts, log_target):
  """Index of the segment whose count range holds ``log_target``."""
  # log_counts falls with the threshold; segment j spans probes j and j+1.
  above = jnp.sum(log_counts[1:-1] > log_target)
  return above.astype(jnp.int32)


def _adaptive_next(threshold, state, selected, target, *, probe_ratios):
  log_ratios = jnp.log(jnp.asarray(probe_ratios, jnp.float32))
  log_thresholds = jnp.log(threshold) + log_ratios
  counts = state.probe_counts
  made_prediction = state.predicted > 0
  observed_drift = jnp.log(jnp.maximum(selected, 1).astype(jnp.float32)) - jnp.log(
      jnp.maximum(state.predicted, 0.5)
  )
  log_drift = jnp.where(
      made_prediction,
      (1 - ADAPTIVE_DRIFT_SMOOTHING) * state.log_drift
      + ADAPTIVE_DRIFT_SMOOTHING * observed_drift,
      state.log_drift,
  )
  log_target = jnp.log(jnp.float32(target)) - log_drift

  x0, y0, slopes = _count_curve(log_thresholds, counts)
  all_counts = jnp.log(jnp.maximum(counts.astype(jnp.float32), 0.5))
  segment = _segment_of(all_counts, log_target)
  log_next = x0[segment] + (log_target - y0[segment]) / slopes[segment]
  max_move = math.log(ADAPTIVE_MAX_MOVE)
  log_next = jnp.clip(log_next, log_thresholds[0] - max_move, log_thresholds[-1] + max_move)
  predicted = jnp.exp(y0[segment] + slopes[segment] * (log_next - x0[segment]))
  new_state = state._replace(log_drift=log_drift, predicted=predicted)
  return jnp.exp(log_next).astype(jnp.float32), new_state


def get_controller(name: str) -> ThresholdController:
  """Returns the threshold controller called ``name``.

  Args:
    name: ``"adaptive"`` or ``"reference"``.

  Returns:
    The `ThresholdController`.

  Raises:
    ValueError: for any other name.
  """
  if name == "reference":
    return ThresholdController("reference", (), hard_threshold_rule, _reference_next)
  if name == "adaptive":
    return ThresholdController(
        "adaptive",
        ADAPTIVE_PROBE_RATIOS,
        hard_threshold_rule,
        lambda *args: _adaptive_next(*args, probe_ratios=ADAPTIVE_PROBE_RATIOS),
    )
  raise ValueError(
      f"Unknown controller {name!r}; expected 'adaptive' (default, reaches and "
      "holds the target density) or 'reference' (the published rule, exactly)."
  )
