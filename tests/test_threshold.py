"""The adaptive controller's curve solver, against a NumPy statement of the rule.

Given the global counts at the probe thresholds, the new threshold is where
the count curve, linear in log-log between the two probes around ``k``,
reaches ``k`` (that segment's own slope, however steep); beyond the probed
range the end segment's slope, clamped, extrapolates at most a factor 4.
"""

from __future__ import annotations

import numpy as np
import pytest

from exdyna_jax import _threshold


def numpy_solve(thresholds, counts, target):
  log_t = np.log(np.asarray(thresholds, np.float64))
  log_c = np.log(np.maximum(np.asarray(counts, np.float64), 0.5))
  log_k = np.log(target)
  for j in range(len(log_t) - 1):  # interpolate inside a bracketing segment
    if log_c[j] >= log_k >= log_c[j + 1]:
      if log_c[j] == log_c[j + 1]:
        return float(np.exp(log_t[j]))
      fraction = (log_k - log_c[j]) / (log_c[j + 1] - log_c[j])
      return float(np.exp(log_t[j] + fraction * (log_t[j + 1] - log_t[j])))
  low, high = _threshold.ADAPTIVE_SLOPE_RANGE
  end = 0 if log_k > log_c[0] else len(log_t) - 2  # extrapolate from an end
  slope = np.clip((log_c[end + 1] - log_c[end]) / (log_t[end + 1] - log_t[end]), low, high)
  reach = np.log(_threshold.ADAPTIVE_MAX_EXTRAPOLATION)
  log_new = np.clip(log_t[end] + (log_k - log_c[end]) / slope, log_t[0] - reach, log_t[-1] + reach)
  return float(np.exp(log_new))


def probes(previous=0.01):
  return previous * np.asarray(_threshold.ADAPTIVE_PROBE_RATIOS, np.float32)


def solve(thresholds, counts, target):
  return float(
      _threshold.solve_count_curve(
          np.asarray(thresholds, np.float32), np.asarray(counts, np.int32), target
      )
  )


def test_probes_are_dense_next_to_the_previous_threshold_and_span_two_octaves():
  octaves = np.asarray(_threshold.ADAPTIVE_PROBE_OCTAVES)
  assert len(octaves) == 17 and np.all(np.diff(octaves) > 0)
  assert octaves[0] == -1 and octaves[-1] == 1 and 0 in octaves
  assert np.min(np.abs(np.diff(octaves))) == pytest.approx(1 / 64)


def test_a_power_law_curve_is_inverted_exactly():
  thresholds = probes()
  counts = np.round(1e3 * (thresholds / 0.01) ** -3.0).astype(np.int64)
  exact = 0.01 * (400 / 1e3) ** (-1 / 3)
  assert solve(thresholds, counts, 400) == pytest.approx(exact, rel=2e-3)


@pytest.mark.parametrize("target", [1126, 700, 200, 5, 50_000, 900_000])
def test_matches_the_numpy_rule_on_a_measured_cliff(target):
  # Counts measured late in training (digits MLP, 1.1M parameters): the count
  # halves within 1/64 of an octave below the previous threshold.
  counts = [200_000, 106_317, 36_435, 6_203, 4_744, 3_471, 2_219, 1_634, 1_108,
            570, 131, 13, 5, 1, 0, 0, 0]
  thresholds = probes()
  assert solve(thresholds, counts, target) == pytest.approx(
      numpy_solve(thresholds, counts, target), rel=1e-5
  )


def test_inside_a_segment_the_result_stays_between_its_probes():
  thresholds = probes()
  counts = [5000] * 8 + [2000, 100] + [0] * 7  # slope about -270 between probes 8 and 9
  new = solve(thresholds, counts, 1000)
  assert thresholds[8] < new < thresholds[9]


def test_a_flat_segment_at_the_target_keeps_its_probe():
  thresholds = probes()
  counts = [900, 800, 700, 600, 500, 500, 500, 400, 300, 200, 100, 90, 80, 70, 60, 50, 40]
  assert solve(thresholds, counts, 500) == pytest.approx(float(thresholds[4]), rel=1e-6)


def test_extrapolation_is_bounded_to_two_octaves_beyond_the_probes():
  thresholds = probes()
  counts = np.full(17, 10)  # everything far too few: the threshold must fall
  new = solve(thresholds, counts, 10_000)
  assert new == pytest.approx(float(thresholds[0]) / 4, rel=1e-5)
