"""Threshold selection inside a partition, against NumPy.

A worker keeps the lowest ``C`` indices of its range ``[begin, end)`` whose
magnitude reaches the threshold, ascending, with the sentinel ``N`` in the
slots left over; ``passed`` counts every element that reached it, kept or
not. When none did, the fallback index ``begin + offset mod (end - begin)``
is sent alone. The cases cover the sparse and the dense ends (a row of 32
elements with one passing element, and every row full), overflow past
``C``, ranges that start and end inside rows and chunks, and NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exdyna_jax.selection import _selection

N = 10_000


def numpy_select(values, threshold, begin, end, capacity, fallback_offset):
  """The rule: the lowest ``capacity`` passing indices of the range, then the fallback."""
  ids = np.arange(begin, end)
  passing = ids[np.abs(values[begin:end]) >= threshold]  # NaN compares False
  indices = np.full(capacity, len(values), np.int32)
  kept = passing[:capacity]
  indices[: len(kept)] = kept
  if len(passing) == 0:
    indices[0] = begin + fallback_offset % (end - begin)
  return indices, len(passing)


def select(values, threshold, begin, end, capacity, chunk, fallback_offset):
  fn = jax.jit(
      lambda v, t, b, e, o: _selection.select_in_range(
          v, t, b, e, capacity=capacity, chunk=chunk, fallback_offset=o
      )
  )
  selection = fn(jnp.asarray(values), jnp.float32(threshold), jnp.int32(begin),
                 jnp.int32(end), jnp.int32(fallback_offset))
  return np.asarray(selection.indices), int(selection.passed)


@pytest.mark.parametrize(
    ("fraction", "capacity"),
    [
        (0.002, 64),  # sparse: most rows empty, the buffer half full
        (0.05, 200),  # overflow: more pass than fit, the lowest are kept
        (0.6, 4000),  # dense: nearly every row non-empty
        (1.0, 10_000),  # everything passes and fits
        (1.0, 1),  # one slot
    ],
)
@pytest.mark.parametrize(("begin", "end", "chunk"), [(0, N, 2048), (37, 9_001, 2048),
                                                     (4_095, 4_130, 64), (9_990, N, 10_000)])
def test_lowest_passing_indices_of_the_range(fraction, capacity, begin, end, chunk):
  rng = np.random.default_rng(int(fraction * 1000) + capacity + begin)
  values = rng.standard_normal(N).astype(np.float32)
  values[rng.random(N) < 0.01] = np.nan
  magnitudes = np.abs(values[begin:end])
  threshold = np.quantile(magnitudes[~np.isnan(magnitudes)], 1 - fraction)
  expected = numpy_select(values, threshold, begin, end, capacity, fallback_offset=5)
  indices, passed = select(values, threshold, begin, end, capacity, chunk, fallback_offset=5)
  np.testing.assert_array_equal(indices, expected[0])
  assert passed == expected[1]


def test_nothing_passes_sends_the_fallback_index():
  values = np.ones(N, np.float32)
  indices, passed = select(values, 2.0, 300, 700, capacity=8, chunk=256, fallback_offset=1234)
  assert passed == 0
  np.testing.assert_array_equal(indices, [300 + 1234 % 400] + [N] * 7)


@pytest.mark.parametrize("seed", range(4))
def test_nth_set_bit_is_the_position_of_that_set_bit(seed):
  rng = np.random.default_rng(seed)
  words = rng.integers(1, 2**32, size=500, dtype=np.uint64).astype(np.uint32)
  words[:32] = np.uint32(1) << np.arange(32, dtype=np.uint32)  # single bits, bit 31 too
  words[32] = np.uint32(0xFFFFFFFF)
  set_bits = [[j for j in range(32) if int(w) >> j & 1] for w in words]
  ranks = np.array([rng.integers(len(bits)) for bits in set_bits], np.int32)
  ranks[32] = 31
  positions = jax.jit(_selection.nth_set_bit)(jnp.asarray(words), jnp.asarray(ranks))
  expected = [bits[rank] for bits, rank in zip(set_bits, ranks, strict=True)]
  np.testing.assert_array_equal(positions, expected)


def test_row_masks_set_one_bit_per_passing_element():
  passed = np.random.default_rng(0).random(100) < 0.4
  masks = np.asarray(_selection.row_masks(jnp.asarray(passed)))
  padded = np.pad(passed, (0, 28)).reshape(4, 32)
  expected = [sum(1 << j for j in range(32) if row[j]) for row in padded]
  np.testing.assert_array_equal(masks.astype(np.int64), expected)


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("size", [1, 7, 64, 500])
def test_first_nonzero_positions_are_those_of_numpy(fraction, size):
  """The first ``size`` nonzero words, ascending, then the fill value: what
  ``np.flatnonzero`` gives, padded (``jnp.nonzero`` with a size and a fill)."""
  rng = np.random.default_rng(int(fraction * 100) + size)
  masks = np.where(rng.random(300) < fraction, rng.integers(1, 2**32, 300), 0).astype(np.uint32)
  got = jax.jit(lambda m: _selection.first_nonzero(m, size, fill_value=300))(masks)
  expected = np.full(size, 300)
  first = np.flatnonzero(masks)[:size]
  expected[: len(first)] = first
  np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize(("begin", "end"), [(0, N), (37, 9_001), (4_095, 4_130), (9_990, N)])
def test_unrolled_first_chunks_change_no_selection_and_no_count(monkeypatch, begin, end):
  """On GPUs the loops run their first chunks unrolled, also past a short
  range's last chunk (`over_chunks`): here forced on the CPU, the lowest
  passing indices and the probe counts are still NumPy's."""
  monkeypatch.setattr(_selection, "UNROLLED_PLATFORMS", ("cpu",))
  rng = np.random.default_rng(begin)
  values = rng.standard_normal(N).astype(np.float32)
  values[rng.random(N) < 0.01] = np.nan
  threshold = 2.0
  selection = jax.jit(lambda v, b, e: _selection.select_in_range(
      v, jnp.float32(threshold), b, e, capacity=64, chunk=1024, unrolled=3, fallback_offset=5)
  )(values, np.int32(begin), np.int32(end))
  expected = numpy_select(values, threshold, begin, end, 64, fallback_offset=5)
  np.testing.assert_array_equal(np.asarray(selection.indices), expected[0])
  assert int(selection.passed) == expected[1]
  thresholds = jnp.asarray([0.5, 1.0, 2.0, 3.0], jnp.float32)
  counts, largest = jax.jit(lambda v, b, e: _selection.count_in_range(
      v, b, e, thresholds, chunk=1024, unrolled=3))(values, np.int32(begin), np.int32(end))
  magnitudes = np.abs(values[begin:end])
  np.testing.assert_array_equal(np.asarray(counts), [np.sum(magnitudes >= t) for t in thresholds])
  assert float(largest) == np.nanmax(magnitudes)


@pytest.mark.parametrize(("num_elements", "num_workers", "chunk"),
                         [(10_000, 4, 1024), (10_000, 8, 313), (4_093, 3, 32), (100, 1, 25)])
def test_unrolled_chunks_never_exceed_the_longest_partitions(num_elements, num_workers, chunk):
  """However ``N`` is cut ``n`` ways, some partition takes at least
  `unrolled_chunks` chunks: unrolling them costs the slowest worker nothing."""
  rng = np.random.default_rng(num_elements + chunk)
  unrolled = _selection.unrolled_chunks(num_elements, num_workers, chunk)
  assert unrolled >= 1
  for _ in range(200):
    cuts = np.sort(rng.integers(0, num_elements + 1, num_workers - 1))
    lengths = np.diff(np.concatenate([[0], cuts, [num_elements]]))
    assert max(-(-lengths // chunk)) >= unrolled
  even = -(-num_elements // num_workers)  # the most even cut, at its longest
  assert -(-even // chunk) == unrolled
