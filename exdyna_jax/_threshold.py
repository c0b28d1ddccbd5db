"""Online control of the global selection threshold.

A controller picks, before selection, the one threshold every worker uses at
this step. Two are provided:

- ``"reference"`` is the published ExDyna/MiCRO rule, exactly: start at
  ``1 / (2 sqrt(k))`` and, from the second step on, scale by ``x1.005`` when
  the previous step's ``K/k > 1.1``, by ``x1.00125`` when
  ``0.909 < K/k <= 1.1`` (the released code's downward nudge inside that band
  can never trigger, so the threshold creeps up there) and by ``x0.995``
  otherwise. Threshold arithmetic is float32.
- ``"adaptive"`` (default) measures instead of guessing. Each worker counts,
  in one pass over its own partition, how many elements pass each of 17
  probe thresholds ``c * 2^x`` around the previous threshold ``c``, with
  ``x`` in ``0, +-1/64, +-1/32, +-1/16, +-3/32, +-1/8, +-1/4, +-1/2, +-1``
  octaves (`ADAPTIVE_PROBE_OCTAVES`); one ``psum`` of those 17 integers
  gives the global count curve of *this* step's accumulated gradient, and
  the threshold is where the curve, interpolated linearly in log-log between
  the two probes around ``k``, meets ``k``. Outside the probed range it
  extrapolates with the end slope, at most two octaves further, and
  re-centres on the next step.

The adaptive rule costs one extra collective per step (17 int32 per worker)
and one read of the worker's partition, in place and chunk by chunk
(`_exchange.count_in_range`), with all 17 counts packed into one reduction.
The probes are dense next to ``c`` because error feedback piles magnitudes
up just below a slowly moving threshold: late in training the count curve
can halve within 1 % of ``c`` (log-log slopes of -50 were measured). On the
digits MLP of ``benchmarks/density_control.py`` (600 steps, 8 workers), the
median ``|K/k - 1|`` after step 20 is 0.24 % at ``k = 850``, 1.2 % at
``k = 85`` and 0.9 % at ``k = 1,126`` (1.1M parameters, d = 0.001).
Probes evenly an eighth of an octave apart, with the segment slope clamped
to ``ADAPTIVE_SLOPE_RANGE``, gave 0.9 %, 3.5 % and 13.7 %.
A predictive variant that reused the previous step's counts (no extra round)
was measured first, on the digits MLP of ``benchmarks/density_control.py``: it
held only a 20 % median error, because error feedback makes the count at a
fixed threshold swing with the previous step's selection. The released ExDyna
code also spends a separate count all-gather per step, so the round count
matches the reference implementation's.

References:
  Yoon & Oh, ExDyna, CCGrid 2024, arXiv:2402.13781, section IV-C.
  Sahu et al., "Rethinking gradient sparsification as total error
  minimization", NeurIPS 2021 (the initial threshold).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax import _integer

# Published rule: band edges as exact (numerator, denominator), and factors.
REFERENCE_UPPER = (11, 10)
REFERENCE_LOWER = (909, 1000)
REFERENCE_FACTORS = (1.005, 1.00125, 0.995)

# Probe offsets in octaves around the previous threshold: 1/64 of an octave
# (1.1 %) apart next to it, where the threshold usually moves and where error
# feedback piles magnitudes up (the count can halve within 1 %), wider out to
# one octave for transients.
_NEAR = (1 / 64, 1 / 32, 1 / 16, 3 / 32, 1 / 8, 1 / 4, 1 / 2, 1)
ADAPTIVE_PROBE_OCTAVES = tuple(sorted((0.0, *_NEAR, *(-x for x in _NEAR))))
ADAPTIVE_PROBE_RATIOS = tuple(2.0**x for x in ADAPTIVE_PROBE_OCTAVES)
ADAPTIVE_MAX_EXTRAPOLATION = 4.0  # at most two octaves beyond the probes
ADAPTIVE_SLOPE_RANGE = (-20.0, -0.1)  # d log K / d log threshold, clamped

Measure = Callable[[jax.Array], jax.Array]
"""``thresholds f32[P] -> global counts int32[P]`` of this step's gradient."""


class ThresholdController(NamedTuple):
  """A threshold rule.

  Attributes:
    name: ``"reference"`` or ``"adaptive"``.
    initial_threshold: ``k -> threshold`` before the first step.
    choose: ``(previous_threshold, previous_selected, target, step, measure)
      -> threshold`` for this step; ``measure`` counts, over all workers, the
      elements of this step's accumulated gradients passing given thresholds.
    num_probes: how many thresholds ``choose`` measures per step (the int32
      counts it all-reduces).
  """

  name: str
  initial_threshold: Callable[[int], float]
  choose: Callable[[jax.Array, jax.Array, int, jax.Array, Measure], jax.Array]
  num_probes: int


def hard_threshold_rule(target: int) -> float:
  """``1 / (2 sqrt(k))``: the hard-threshold rule of Sahu et al."""
  return 1.0 / (2.0 * math.sqrt(target))


def reference_factor(selected: jax.Array, target: int) -> jax.Array:
  """The published multiplicative step for the previous count ``K``."""
  target = jnp.int32(target)
  return jnp.where(
      _integer.exceeds_ratio(selected, target, *REFERENCE_UPPER),
      jnp.float32(REFERENCE_FACTORS[0]),
      jnp.where(
          _integer.exceeds_ratio(selected, target, *REFERENCE_LOWER),
          jnp.float32(REFERENCE_FACTORS[1]),
          jnp.float32(REFERENCE_FACTORS[2]),
      ),
  )


def _reference_choose(previous, selected, target, step, measure):
  del measure
  return jnp.where(step == 0, previous, previous * reference_factor(selected, target))


def solve_count_curve(thresholds: jax.Array, counts: jax.Array, target: int) -> jax.Array:
  """Threshold at which a measured count curve reaches ``target``.

  Args:
    thresholds: float32 ``[P]`` ascending probe thresholds.
    counts: int32 ``[P]`` elements passing each (non-increasing).
    target: the wanted count ``k``.

  Returns:
    float32 threshold: log-log linear interpolation between the two probes
    around ``target`` (with that segment's own slope, however steep), or,
    beyond the probed range, extrapolation with the end segment's slope
    clamped to ``ADAPTIVE_SLOPE_RANGE``, at most
    ``ADAPTIVE_MAX_EXTRAPOLATION`` beyond the end probe.
  """
  log_thresholds = jnp.log(thresholds)
  log_counts = jnp.log(jnp.maximum(counts.astype(jnp.float32), 0.5))
  log_target = jnp.log(jnp.float32(target))
  # Segment j joins probes j and j+1; counts fall as thresholds rise.
  segment = jnp.sum(log_counts[1:-1] > log_target).astype(jnp.int32)
  rise = log_counts[segment + 1] - log_counts[segment]
  run = log_thresholds[segment + 1] - log_thresholds[segment]
  below = log_target - log_counts[segment]  # <= 0 inside the probed range
  inside = (below <= 0) & (log_target >= log_counts[segment + 1])
  # Inside a segment its own slope, however steep (the result stays between
  # its probes); beyond the ends the end slope, clamped.
  slope = jnp.where(inside, rise / run, jnp.clip(rise / run, *ADAPTIVE_SLOPE_RANGE))
  step = jnp.where(inside & (rise == 0), 0.0, below / jnp.where(slope == 0, -1.0, slope))
  log_threshold = log_thresholds[segment] + step
  reach = math.log(ADAPTIVE_MAX_EXTRAPOLATION)
  log_threshold = jnp.clip(log_threshold, log_thresholds[0] - reach, log_thresholds[-1] + reach)
  return jnp.exp(log_threshold).astype(jnp.float32)


def _adaptive_choose(previous, selected, target, step, measure):
  del selected, step
  thresholds = previous * jnp.asarray(ADAPTIVE_PROBE_RATIOS, jnp.float32)
  return solve_count_curve(thresholds, measure(thresholds), target)


CONTROLLERS = {
    "reference": ThresholdController("reference", hard_threshold_rule, _reference_choose, 0),
    "adaptive": ThresholdController(
        "adaptive", hard_threshold_rule, _adaptive_choose, len(ADAPTIVE_PROBE_RATIOS)
    ),
}


def get_controller(name: str) -> ThresholdController:
  """Returns the threshold controller called ``name``.

  Args:
    name: ``"adaptive"`` or ``"reference"``.

  Returns:
    The `ThresholdController`.

  Raises:
    ValueError: for any other name.
  """
  if name not in CONTROLLERS:
    raise ValueError(
        f"Unknown controller {name!r}; expected 'adaptive' (default: measures this "
        "step's count curve and holds the target density) or 'reference' (the "
        "published rule, exactly)."
    )
  return CONTROLLERS[name]
