"""Threshold selection inside a range of the accumulated gradient, and exact top-k.

The vector is read in rows of ``ROW`` elements: `row_counts` counts, per row,
how many elements pass each of several predicates in one pass (packed 6-bit
fields), `count_in_range` counts a partition for many probe thresholds, and
`select_in_range` keeps the lowest ``C`` passing indices of a partition by
finding the first non-empty rows, then compacting only those. Both loop over
chunks that cover the range, so their cost follows the partition's length.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ROW = 32  # elements per row of the two-level compaction
FIELD_BITS = 6  # a row of 32 elements has at most 32 passing: 6 bits
FIELDS_PER_WORD = 5  # 5 x 6 bits fit an int32
MIN_CHUNK = 1 << 16  # elements per iteration of `count_in_range`, at least


def row_counts(magnitudes: jax.Array, thresholds: jax.Array) -> jax.Array:
  """Counts, per row of 32 elements, how many magnitudes reach each threshold.

  All thresholds are counted in one pass over the vector: up to five 6-bit
  counts are packed into one int32 per element, and the packed words of all
  thresholds are summed over the rows by a single reduction, so the vector
  is read once however many thresholds are probed. The program is the same
  size for any number of thresholds (five packing steps).

  Args:
    magnitudes: float32 ``[N]`` (an element to leave out: -1; NaN reaches
      no threshold).
    thresholds: float32 ``[L]``, positive.

  Returns:
    int32 ``[ceil(N / 32), L]`` per-row counts of ``magnitudes >= thresholds[l]``.
  """
  (num_thresholds,) = thresholds.shape
  num_words = -(-num_thresholds // FIELDS_PER_WORD)
  # Threshold l goes to field l % 5 of word l // 5; padding thresholds count nothing.
  fields = jnp.pad(thresholds, (0, num_words * FIELDS_PER_WORD - num_thresholds),
                   constant_values=jnp.inf).reshape(num_words, FIELDS_PER_WORD)
  packed = sum(  # [words, N]
      (magnitudes >= fields[:, j, None]).astype(jnp.int32) << (FIELD_BITS * j)
      for j in range(min(FIELDS_PER_WORD, num_thresholds))
  )
  packed = jnp.pad(packed, ((0, 0), (0, -magnitudes.shape[0] % ROW)))
  sums = jnp.sum(packed.reshape(num_words, -1, ROW), axis=2)  # [words, rows]
  shifts = FIELD_BITS * jnp.arange(FIELDS_PER_WORD, dtype=jnp.int32)
  columns = (sums[:, None, :] >> shifts[None, :, None]) & ((1 << FIELD_BITS) - 1)
  return columns.reshape(num_words * FIELDS_PER_WORD, -1)[:num_thresholds].T


def chunk_length(num_elements: int, num_workers: int) -> int:
  """Elements per iteration of `count_in_range` for a vector split ``num_workers`` ways.

  An eighth of a fair share (whole rows), at least `MIN_CHUNK` and at most
  ``N``: a partition of fair size is counted in about eight iterations (few
  enough that a loop's per-iteration overhead, a condition check on a GPU,
  stays in microseconds), and at most one chunk at each end is read beyond
  it.
  """
  eighth = -(-num_elements // (8 * num_workers))
  return min(num_elements, max(MIN_CHUNK, -(-eighth // ROW) * ROW))


def count_in_range(
    accumulated: jax.Array,
    begin: jax.Array,
    end: jax.Array,
    thresholds: jax.Array,
    *,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
  """Elements of ``accumulated[begin:end]`` with ``|a| >= t``, for each threshold ``t``.

  A loop over the chunks of ``chunk`` elements that overlap ``[begin, end)``
  reads each of them once, counts all thresholds (`row_counts`) and takes the
  largest magnitude, so the cost follows the length of the range, not a
  static bound on it.

  Args:
    accumulated: float32 ``[N]``.
    begin: int32 first index of the range.
    end: int32 one past its last index.
    thresholds: float32 ``[P]`` (``P`` static).
    chunk: static elements per iteration (see `chunk_length`).

  Returns:
    ``(counts, largest)``: int32 ``[P]`` counts and the float32 largest
    ``|a|`` in the range (0 for an empty range; NaN is never the largest).
  """
  num_elements = accumulated.shape[0]
  chunk = min(chunk, num_elements)

  def count_chunk(index, carry):
    counts, largest = carry
    nominal = index * chunk
    start = jnp.minimum(nominal, num_elements - chunk)  # the last chunk shifts left to fit
    ids = start + jnp.arange(chunk, dtype=jnp.int32)
    # From the nominal start only: a shifted last chunk overlaps the one before.
    inside = (ids >= jnp.maximum(begin, nominal)) & (ids < end)
    # Outside the range a magnitude of -1 passes no threshold (NaN passes none either).
    magnitudes = jnp.abs(jax.lax.dynamic_slice(accumulated, (start,), (chunk,)))
    magnitudes = jnp.where(inside & ~jnp.isnan(magnitudes), magnitudes, -1.0)
    counts = counts + jnp.sum(row_counts(magnitudes, thresholds), axis=0)
    return counts, jnp.maximum(largest, jnp.max(magnitudes))

  first, last = begin // chunk, (end + chunk - 1) // chunk
  # Zeros typed like the gradient (per worker under shard_map), so the loop
  # carry has the type the body returns.
  zero = jnp.zeros_like(accumulated, shape=())
  carry = (jnp.zeros(thresholds.shape, jnp.int32) + zero.astype(jnp.int32), zero)
  return jax.lax.fori_loop(first, last, count_chunk, carry)


class Selection(NamedTuple):
  """What one worker chose this step.

  Attributes:
    indices: int32 ``[C]`` chosen indices, sentinel ``N`` in unused slots.
    passed: int32 number of elements that passed the threshold (before
      capacity).
  """

  indices: jax.Array
  passed: jax.Array


def select_in_range(
    accumulated: jax.Array,
    threshold: jax.Array,
    begin: jax.Array,
    end: jax.Array,
    *,
    capacity: int,
    chunk: int,
    fallback_offset: jax.Array | None = None,
) -> Selection:
  """The lowest ``capacity`` indices in ``[begin, end)`` with ``|a| >= threshold``.

  A loop over the chunks that overlap the range (as `count_in_range`) reads
  each once: it counts the passing elements per row of 32 and keeps the
  first ``capacity`` non-empty rows; only those rows are then read again and
  compacted. The cost follows the length of the range, so partitions of any
  length cost what they hold.

  Args:
    accumulated: float32 ``[N]``.
    threshold: float32 scalar.
    begin: int32 first index of the range.
    end: int32 one past its last index (``> begin``).
    capacity: static buffer size ``C``.
    chunk: static elements per iteration (see `chunk_length`).
    fallback_offset: if given and nothing passes, index
      ``begin + fallback_offset mod (end - begin)`` is sent alone (so every
      worker always sends something, as the reference does).

  Returns:
    The `Selection`, indices ascending.
  """
  num_elements = accumulated.shape[0]
  chunk = min(chunk, num_elements)
  num_rows = -(-chunk // ROW)
  take = min(capacity, num_rows)  # rows one chunk can contribute

  def scan_chunk(index, carry):
    row_starts, row_floors, filled, passed = carry
    nominal = index * chunk
    start = jnp.minimum(nominal, num_elements - chunk)  # the last chunk shifts left to fit
    floor = jnp.maximum(begin, nominal)  # a shifted chunk's overlap is its neighbour's
    ids = start + jnp.arange(chunk, dtype=jnp.int32)
    magnitudes = jnp.abs(jax.lax.dynamic_slice(accumulated, (start,), (chunk,)))
    inside = (ids >= floor) & (ids < end)
    counts = row_counts(jnp.where(inside, magnitudes, -1.0), threshold[None])[:, 0]
    (rows,) = jnp.nonzero(counts > 0, size=take, fill_value=num_rows)
    at = (jnp.minimum(filled, capacity),)
    row_starts = jax.lax.dynamic_update_slice(row_starts, start + rows * ROW, at)
    row_floors = jax.lax.dynamic_update_slice(row_floors, jnp.full((take,), floor), at)
    return row_starts, row_floors, filled + jnp.sum(counts > 0), passed + jnp.sum(counts)

  first, last = begin // chunk, (end + chunk - 1) // chunk
  # Zero typed like the gradient (per worker under shard_map), so the loop
  # carry has the type the body returns even where the range is the same on
  # every worker.
  zero = jnp.zeros_like(accumulated, jnp.int32, shape=())
  empty = jnp.full((capacity + take,), num_elements, jnp.int32) + zero
  row_starts, row_floors, filled, passed = jax.lax.fori_loop(
      first, last, scan_chunk, (empty, empty, zero, zero)
  )

  # Compact the picked rows: the first C passing elements lie in the first C
  # non-empty rows.
  picked_rows = jnp.arange(capacity) < filled
  element_ids = row_starts[:capacity, None] + jnp.arange(ROW, dtype=jnp.int32)
  values = accumulated.at[element_ids].get(mode="fill", fill_value=0)
  picked = (
      picked_rows[:, None]
      & (element_ids >= row_floors[:capacity, None])
      & (element_ids < end)
      & (jnp.abs(values) >= threshold)
  )
  per_row = jnp.sum(picked, axis=1, dtype=jnp.int32)
  row_offsets = jnp.cumsum(per_row) - per_row
  rank_in_row = jnp.cumsum(picked, axis=1, dtype=jnp.int32) - 1
  slots = jnp.where(picked, row_offsets[:, None] + rank_in_row, capacity)
  indices = jnp.full((capacity,), num_elements, jnp.int32)
  indices = indices.at[slots.reshape(-1)].set(element_ids.reshape(-1), mode="drop")
  if fallback_offset is not None:
    fallback = begin + fallback_offset % (end - begin)
    indices = indices.at[0].set(jnp.where(passed == 0, fallback, indices[0]))
  return Selection(indices, passed)


def select_top_k(accumulated: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-``k`` of ``|accumulated|`` (ties towards the lower index).

  Args:
    accumulated: float32 ``[N]`` accumulated gradient of this worker.
    k: static number of indices.

  Returns:
    ``(indices, kth)``: int32 ``[k]`` indices of the ``k`` largest magnitudes,
    largest first; and the float32 ``k``-th largest magnitude.
  """
  magnitudes, indices = jax.lax.top_k(jnp.abs(accumulated), k)
  # min, not magnitudes[k - 1]: indexing the sorted output makes XLA on CPU
  # compile a full sort of N instead of its top-k kernel (100x slower).
  return indices.astype(jnp.int32), jnp.min(magnitudes)
