"""The adaptive controller's measurement and curve solver, against NumPy.

Each worker counts the elements of its partition passing each probe; the
counts, summed over workers, are a count curve. Given it, the new threshold
is where the curve, linear in log-log between the two probes around ``k``,
reaches ``k`` (that segment's own slope, however steep); beyond the probed
range the end segment's slope, clamped, extrapolates at most a factor 4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exdyna_jax.selection import _count_curve, _selection, _threshold


def numpy_solve(thresholds, counts, target, largest=None):
  """The rule in float64; ``largest`` adds the point (largest, 1) and caps the result."""
  if largest is not None:
    if counts[0] == counts[-1] > target:  # every probe below the distribution
      return min(max(largest / _count_curve.MAX_EXTRAPOLATION, max(thresholds)), largest)
    points = sorted([*zip(thresholds, counts, strict=True), (largest, 1)])
    thresholds, counts = [p[0] for p in points], [p[1] for p in points]
    return min(numpy_solve(thresholds, counts, target), largest)
  log_t = np.log(np.asarray(thresholds, np.float64))
  log_c = np.log(np.maximum(np.asarray(counts, np.float64), 0.5))
  log_k = np.log(target)
  for j in range(len(log_t) - 1):  # interpolate inside a bracketing segment
    if log_c[j] >= log_k >= log_c[j + 1]:
      if log_c[j] == log_c[j + 1]:
        return float(np.exp(log_t[j]))
      fraction = (log_k - log_c[j]) / (log_c[j + 1] - log_c[j])
      return float(np.exp(log_t[j] + fraction * (log_t[j + 1] - log_t[j])))
  low, high = _count_curve.SLOPE_RANGE
  end = 0 if log_k > log_c[0] else len(log_t) - 2  # extrapolate from an end
  slope = np.clip((log_c[end + 1] - log_c[end]) / (log_t[end + 1] - log_t[end]), low, high)
  reach = np.log(_count_curve.MAX_EXTRAPOLATION)
  log_new = np.clip(log_t[end] + (log_k - log_c[end]) / slope, log_t[0] - reach, log_t[-1] + reach)
  return float(np.exp(log_new))


# The 17 probe offsets (octaves) at which the counts below were measured; the
# solver takes any ascending probes, so its tests keep them.
MEASURED_OCTAVES = (-1, -1 / 4, -1 / 8, -1 / 16, -1 / 32, -1 / 64, -1 / 128, -1 / 256, 0,
                    1 / 256, 1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1)


def probes(previous=0.01):
  return previous * np.exp2(np.asarray(MEASURED_OCTAVES)).astype(np.float32)


def solve(thresholds, counts, target):
  return float(
      _count_curve.solve_count_curve(
          np.asarray(thresholds, np.float32), np.asarray(counts, np.int32), target
      )
  )


def test_probes_are_dense_next_to_the_previous_threshold_and_span_two_octaves():
  octaves = np.asarray(_threshold.ADAPTIVE_PROBE_OCTAVES)
  assert len(octaves) == 27 and np.all(np.diff(octaves) > 0)
  assert octaves[0] == -1 and octaves[-1] == 1 and 0 in octaves
  assert np.min(np.abs(np.diff(octaves))) == pytest.approx(1 / 512)
  # Within a quarter octave no segment is wider than 1/16 octave ...
  near = octaves[np.abs(octaves) <= 1 / 4]
  assert np.max(np.diff(near)) == pytest.approx(1 / 16)
  # ... and beyond it no segment is wider than half an octave.
  assert np.max(np.diff(octaves)) == pytest.approx(1 / 2)
  # 27 probes take six count words of five 6-bit fields.
  assert -(-len(octaves) // _selection.FIELDS_PER_WORD) == 6


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


@pytest.mark.parametrize(
    ("counts", "largest"),
    [
        ([0] * 17, 0.003),  # every probe above the largest magnitude: restart below it
        ([50_000] * 17, 40.0),  # every probe below the distribution: restart at largest / 4
        ([50_000] * 17, 0.03),  # ... within 4x of the largest: at the highest probe, not below
        ([50_000] * 9 + [40_000, 30_000, 20_000] + [10_000] * 5, 40.0),  # bracketed by largest
        ([900, 800, 700, 600, 500, 400, 300, 200, 100, 90, 80, 70, 60, 50, 40, 30, 20], 0.05),
    ],
)
def test_the_largest_magnitude_brackets_a_curve_the_probes_miss(counts, largest):
  thresholds = probes()
  got = float(
      _count_curve.solve_count_curve(
          np.asarray(thresholds, np.float32), np.asarray(counts, np.int32), 1000,
          np.float32(largest),
      )
  )
  assert got == pytest.approx(numpy_solve(list(thresholds), counts, 1000, largest), rel=1e-5)
  assert got <= largest


def test_the_correction_learns_a_persistent_bias_only_on_steady_steps():
  correction = np.float32(1.0)
  for _ in range(30):  # the curve is biased: aiming at k c transmits 1.1 k c
    sent = np.int32(round(1.1 * 1000 * float(correction)))
    correction = _threshold.correct(correction, sent, 1000, np.bool_(True))
  assert float(correction) == pytest.approx(1 / 1.1, rel=0.01)
  unchanged = _threshold.correct(correction, np.int32(5), 1000, np.bool_(False))
  assert float(unchanged) == float(correction)
  high = _threshold.CORRECTION_RANGE[1]
  for _ in range(30):  # a transient never winds it past its range
    correction = _threshold.correct(correction, np.int32(1), 1000, np.bool_(True))
  assert float(correction) == pytest.approx(high)


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


# Full buffers: where the floor on what passes binds because some workers pass
# more than their C buffer slots (the curve of what is transmitted stays short
# of k), the threshold rises until the first of them comes down to C, while
# the other workers lose at most ADAPTIVE_RELIEF_LOSS k.


def numpy_count_at(thresholds, counts, threshold):
  """The curve at ``threshold``, log-log linear between probes (end segments extended)."""
  log_t = np.log(np.asarray(thresholds, np.float64))
  log_c = np.log(np.maximum(np.asarray(counts, np.float64), 0.5))
  j = int(np.clip(np.searchsorted(log_t, np.log(threshold), side="right") - 1, 0, len(log_t) - 2))
  fraction = (np.log(threshold) - log_t[j]) / (log_t[j + 1] - log_t[j])
  return float(np.exp(log_c[j] + fraction * (log_c[j + 1] - log_c[j])))


def numpy_choose(thresholds, counts, largest, *, target, capacity, slots, correction=1.0):
  """The adaptive controller on measured per-worker counts ``[n, P]``, in float64."""
  counts = np.asarray(counts, np.int64)
  sendable = min(len(counts) * capacity, slots)
  transmitted = np.minimum(counts, capacity).sum(0)
  steered = numpy_solve(thresholds, transmitted, target * correction, largest)
  floor = numpy_solve(thresholds, counts.sum(0), sendable, largest)
  threshold = max(steered, floor)
  if steered >= floor or not thresholds[0] <= threshold <= thresholds[-1]:
    return threshold
  at = np.array([numpy_count_at(thresholds, c, threshold) for c in counts])
  full = at > capacity
  if not full.any():
    return threshold
  first_down = min(numpy_solve(thresholds, c, capacity) for c in counts[full])
  keep = at[~full].sum() - _threshold.ADAPTIVE_RELIEF_LOSS * target
  room = counts[~full].sum(0)
  affordable = numpy_solve(thresholds, room, keep) if keep > 0.5 else np.inf
  return max(threshold, min(first_down, affordable))


def power_law_counts(thresholds, previous, scales, slopes):
  ratio = np.asarray(thresholds, np.float64)[None] / previous
  return np.round(np.asarray(scales)[:, None] * ratio ** -np.asarray(slopes)[:, None])


@pytest.mark.parametrize(
    ("scales", "slopes", "correction", "ratio_range"),
    [
        # A burst: worker 0 passes 3000 x^-8 at x times the previous threshold,
        # the others a few; rising costs nothing until worker 0 is down to C
        # at x = 5^(1/8) = 1.223.
        ([3000, 5, 5, 5], [8, 1, 1, 1], 1.0, (1.21, 1.235)),
        # The others pass 3 x 400 x^-6: from the floor (x = 1.32) to about
        # x = 1.45 they lose 0.1 k, short of where worker 0 comes down to C
        # (x = 1.494).
        ([2000, 400, 400, 400], [3, 6, 6, 6], 1.0, (1.4, 1.485)),
        # The floor binds (the target is 2 k) but no buffer is full: unchanged.
        ([300, 300, 300, 300], [4, 4, 4, 4], 2.0, None),
    ],
)
def test_full_buffers_raise_the_threshold_where_that_sends_almost_as_much(
    scales, slopes, correction, ratio_range
):
  previous, target, capacity, slots = 0.01, 1000, 600, 1100
  thresholds = previous * np.asarray(_threshold.ADAPTIVE_PROBE_RATIOS, np.float32)
  counts = power_law_counts(thresholds, previous, scales, slopes)
  largest = 3 * previous

  np.testing.assert_allclose(np.asarray(_threshold.probe_thresholds(jnp.float32(previous))),
                             thresholds)
  probe = _threshold.ProbeCounts(jnp.asarray(counts, jnp.int32), jnp.float32(largest))
  choose = _threshold.get_controller("adaptive").choose
  budget = _threshold.Budget(target, capacity, slots)
  got, steady = choose(
      jnp.float32(previous), jnp.int32(0), budget, jnp.float32(correction), jnp.int32(5), probe
  )
  expected = numpy_choose(
      list(thresholds), counts, largest, target=target, capacity=capacity, slots=slots,
      correction=correction,
  )
  assert float(got) == pytest.approx(expected, rel=1e-4)
  assert not steady  # a step short of k teaches the correction nothing
  floor = numpy_solve(list(thresholds), counts.sum(0), slots, largest)
  if ratio_range is None:
    assert float(got) == pytest.approx(floor, rel=1e-4)
  else:
    low, high = ratio_range
    assert float(got) > floor * 1.05
    assert low < float(got) / previous < high


# What the controller measures: every worker counts the elements of its own
# partition passing each probe, chunk by chunk, in place.


def numpy_count(values, begin, end, thresholds):
  magnitudes = np.abs(values[begin:end].astype(np.float64))
  return np.array([(magnitudes >= t).sum() for t in thresholds])  # NaN passes none


@pytest.mark.parametrize(
    ("num_elements", "chunk", "begin", "end"),
    [
        (1000, 96, 130, 871),  # 741 = 7 x 96 + 69: the last chunk shifts left
        (1000, 96, 0, 1000),
        (1000, 96, 960, 1000),  # shorter than a chunk: one, ending at the range's end
        (1000, 96, 10, 40),  # shorter than a chunk, near the start: one, from 0
        (1000, 96, 400, 400),  # empty
        (1000, 4096, 17, 999),  # one chunk longer than the vector
        (1001, 32, 5, 1001),  # a partial last row
    ],
)
def test_probe_counts_match_numpy_chunk_by_chunk(num_elements, chunk, begin, end):
  rng = np.random.default_rng(num_elements + begin)
  values = (rng.standard_t(3.0, num_elements) * 0.01).astype(np.float32)
  values[[3, 500, 998]] = [np.nan, np.inf, -np.inf]
  thresholds = probes(0.01)
  counts, largest = jax.jit(
      lambda v, b, e, t: _selection.count_in_range(v, b, e, t, chunk=chunk)
  )(values, np.int32(begin), np.int32(end), thresholds)
  np.testing.assert_array_equal(np.asarray(counts), numpy_count(values, begin, end, thresholds))
  magnitudes = np.abs(values[begin:end])
  expected = np.max(magnitudes[~np.isnan(magnitudes)], initial=0.0)  # inf counts, NaN does not
  assert float(largest) == expected


def test_chunks_are_a_quarter_of_a_fair_share_within_bounds():
  assert _selection.chunk_length(11_173_962, 8) == 349_216  # ceil(N / 32), whole rows
  assert _selection.chunk_length(1_000_000, 8) == _selection.MIN_CHUNK
  assert _selection.chunk_length(5_000, 8) == 5_000


@pytest.mark.parametrize("begin", [0, 1, 2**30])
@pytest.mark.parametrize("chunk", [4096, 2**20, 2**30])
def test_a_partition_near_the_int32_limit_is_counted_in_whole_chunks(begin, chunk):
  """``ceil((end - begin) / chunk)`` for a partition ending at ``2**31 - 1``: no
  intermediate past int32 (it used to give a negative count, so nothing was read)."""
  end = 2**31 - 1
  for traced in (False, True):
    count = (jax.jit(_selection.num_chunks, static_argnums=2) if traced
             else _selection.num_chunks)(jnp.int32(begin), jnp.int32(end), chunk)
    assert int(count) == -(-(end - begin) // chunk)


@pytest.mark.parametrize("num_elements", [1000, 1001])
@pytest.mark.parametrize("chunk", [1, 32, 96, 1000])
def test_a_range_is_read_once_in_chunks_from_its_first_element(num_elements, chunk):
  """Chunk ``i`` starts at ``begin + i * chunk`` (the last one shifts left, inside
  the vector); together the chunks hold every element of the range exactly
  once, and there are ``ceil((end - begin) / chunk)`` of them."""
  rng = np.random.default_rng(chunk)
  ranges = [(0, num_elements), (0, 0), (num_elements, num_elements)]
  ranges += [tuple(sorted(rng.integers(0, num_elements + 1, 2))) for _ in range(40)]
  window = jax.jit(jax.vmap(lambda i, b, e: _selection.chunk_window(i, b, e, chunk),
                            in_axes=(0, None, None)))
  for begin, end in ranges:
    count = int(_selection.num_chunks(np.int32(begin), np.int32(end), chunk))
    assert count == -(-(end - begin) // chunk)
    starts, new = window(np.arange(count, dtype=np.int32), np.int32(begin), np.int32(end))
    held = np.zeros(num_elements, int)
    for index, (start, mask) in enumerate(zip(np.asarray(starts), np.asarray(new), strict=True)):
      assert 0 <= start <= num_elements - chunk
      if index < count - 1:
        assert start == begin + index * chunk
      held[start:start + chunk] += mask
    np.testing.assert_array_equal(held, (np.arange(num_elements) >= begin)
                                  & (np.arange(num_elements) < end))
