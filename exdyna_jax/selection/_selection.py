"""Threshold selection inside a range of the accumulated gradient, and exact top-k.

The vector is read in rows of ``ROW`` elements: `row_counts` counts, per row,
how many elements pass each of several predicates in one pass (packed 6-bit
fields), `count_in_range` counts a partition for many probe thresholds, and
`select_in_range` keeps the lowest ``C`` passing indices of a partition from
the bit masks of its first ``C`` non-empty rows (`first_nonzero`). Both read the range in
chunks that start at its first element (`chunk_window`), so their cost
follows the partition's length; on AMD GPUs the first chunks run unrolled
(`over_chunks`), and on NVIDIA GPUs both passes are Pallas kernels instead
(`_range_kernels`, on `_range_kernels.KERNEL_PLATFORMS`), with the same results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.selection import _range_kernels

ROW = 32  # elements per row of the two-level compaction
FIELD_BITS = 6  # a row of 32 elements has at most 32 passing: 6 bits
FIELDS_PER_WORD = 5  # 5 x 6 bits fit an int32
MIN_CHUNK = 1 << 16  # elements per iteration of `count_in_range`, at least
UNROLLED_PLATFORMS = ("cuda", "rocm")  # where `over_chunks` unrolls: GPUs


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
  """Elements per iteration of the loops over a partition, for ``N`` split ``n`` ways.

  A quarter of a fair share (whole rows), at least `MIN_CHUNK` and at most
  ``N``: a partition of fair size is read in four iterations. A GPU reads
  each iteration's loop condition back to the host and launches the next
  one's kernels after it (tens of microseconds an iteration); a longer
  chunk reads more beyond the partition's end (at most one chunk).
  """
  quarter = -(-num_elements // (4 * num_workers))
  return min(num_elements, max(MIN_CHUNK, -(-quarter // ROW) * ROW))


def num_chunks(begin: jax.Array, end: jax.Array, chunk: int) -> jax.Array:
  """Chunks of ``chunk`` elements that read ``[begin, end)``: ``ceil((end - begin) / chunk)``.

  Without an intermediate past ``end - begin``: a partition of nearly
  ``2**31`` elements would overflow int32 in ``end - begin + chunk - 1``.
  """
  length = end - begin
  return length // chunk + (length % chunk > 0).astype(length.dtype)


def unrolled_chunks(num_elements: int, num_workers: int, chunk: int) -> int:
  """Iterations over a partition that some worker runs every step.

  Of ``n`` partitions that cut ``N`` elements, the longest holds at least
  ``ceil(N / n)``, so it takes at least ``ceil(ceil(N / n) / chunk)`` chunks:
  unrolling that many (`over_chunks`) adds nothing to the slowest worker.
  """
  fair_share = -(-num_elements // num_workers)
  return -(-fair_share // chunk)


def over_chunks(count: jax.Array, body: Callable, carry: Any, *, unrolled: int = 0) -> Any:
  """``lax.fori_loop(0, count, body, carry)``; on GPUs its first ``unrolled`` iterations unrolled.

  A GPU runs a ``while`` loop from the host: it reads the loop condition back
  after every iteration, then launches the body's kernels again; unrolling
  the first iterations saves those reads (`benchmarks/gpu.py`, the REPORT's
  GPU section). Unrolled iterations run even where ``count`` is smaller, so
  ``body`` must add nothing at an index at or
  past ``count`` (`chunk_window`'s ``new`` is then empty), and ``unrolled``
  should be at most what the slowest worker runs anyway (`unrolled_chunks`).
  A CPU runs a loop at no cost per iteration, so there the loop stays whole:
  the extra iterations of a short partition would only read more.

  Args:
    count: int32 iterations.
    body: ``(index, carry) -> carry``.
    carry: the loop's initial carry.
    unrolled: static iterations to unroll (on the platforms in `UNROLLED_PLATFORMS`).

  Returns:
    The final carry.
  """
  def unroll_first(carry):
    carry = jax.lax.fori_loop(0, unrolled, body, carry, unroll=True)
    return jax.lax.fori_loop(unrolled, count, body, carry)

  def whole(carry):
    return jax.lax.fori_loop(0, count, body, carry)

  if not unrolled:
    return whole(carry)
  return jax.lax.platform_dependent(
      carry, **dict.fromkeys(UNROLLED_PLATFORMS, unroll_first), default=whole)


def chunk_window(index: jax.Array, begin: jax.Array, end: jax.Array, chunk: int
                 ) -> tuple[jax.Array, jax.Array]:
  """Where iteration ``index`` reads the range ``[begin, end)``, and which of it is new.

  Chunk ``i`` starts at ``begin + i * chunk``; the last one shifts left to
  end at ``end`` (or to start at 0, when the range is shorter than a chunk),
  so the range is read in `num_chunks` slices of static length with at most
  one chunk's length read beyond it. The vector must be at least ``chunk``
  long.

  Returns:
    ``(start, new)``: int32 where the slice starts, and bool ``[chunk]``,
    True where an element is in the range and no earlier chunk holds it.
  """
  nominal = begin + index * chunk
  start = jnp.maximum(jnp.minimum(nominal, end - chunk), 0)
  ids = start + jnp.arange(chunk, dtype=jnp.int32)
  return start, (ids >= nominal) & (ids < end)


def count_in_range(
    accumulated: jax.Array,
    begin: jax.Array,
    end: jax.Array,
    thresholds: jax.Array,
    *,
    chunk: int,
    unrolled: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Elements of ``accumulated[begin:end]`` with ``|a| >= t``, for each threshold ``t``.

  A loop over `num_chunks` chunks of ``chunk`` elements (`chunk_window`)
  counts all thresholds in each (`row_counts`) and takes the largest
  magnitude, so the cost follows the length of the range, not a static bound
  on it.

  Args:
    accumulated: float32 ``[N]``.
    begin: int32 first index of the range.
    end: int32 one past its last index.
    thresholds: float32 ``[P]`` (``P`` static).
    chunk: static elements per iteration (see `chunk_length`).
    unrolled: static iterations unrolled on GPUs (`over_chunks`).

  Returns:
    ``(counts, largest)``: int32 ``[P]`` counts and the float32 largest
    ``|a|`` in the range (0 for an empty range; NaN is never the largest).
  """
  num_elements = accumulated.shape[0]
  chunk = min(chunk, num_elements)

  def count_chunk(index, carry):
    counts, largest = carry
    start, inside = chunk_window(index, begin, end, chunk)
    # Outside the range a magnitude of -1 passes no threshold (NaN passes none either).
    magnitudes = jnp.abs(jax.lax.dynamic_slice(accumulated, (start,), (chunk,)))
    magnitudes = jnp.where(inside & ~jnp.isnan(magnitudes), magnitudes, -1.0)
    counts = counts + jnp.sum(row_counts(magnitudes, thresholds), axis=0)
    return counts, jnp.maximum(largest, jnp.max(magnitudes))

  def loop(accumulated, begin, end, thresholds):
    # Zeros typed like the gradient (per worker under shard_map), so the loop
    # carry has the type the body returns.
    zero = jnp.zeros_like(accumulated, shape=())
    carry = (jnp.zeros(thresholds.shape, jnp.int32) + zero.astype(jnp.int32), zero)
    return over_chunks(num_chunks(begin, end, chunk), count_chunk, carry, unrolled=unrolled)

  def kernel(platform):
    return functools.partial(
        _range_kernels.count_in_range, chunk=chunk, interpret=platform == "cpu")

  return _range_kernels.on_kernel_platforms(kernel, loop, accumulated, begin, end, thresholds)


class Selection(NamedTuple):
  """What one worker chose this step.

  Attributes:
    indices: int32 ``[C]`` chosen indices, sentinel ``N`` in unused slots.
    passed: int32 number of elements that passed the threshold (before
      capacity).
  """

  indices: jax.Array
  passed: jax.Array


def row_masks(passed: jax.Array) -> jax.Array:
  """One uint32 per row of 32 elements: bit ``j`` of row ``r`` is element ``32 r + j``.

  Args:
    passed: bool ``[L]`` (padded with False to whole rows).

  Returns:
    uint32 ``[ceil(L / 32)]``.
  """
  rows = jnp.pad(passed, (0, -passed.shape[0] % ROW)).reshape(-1, ROW)
  bits = rows.astype(jnp.uint32) << jnp.arange(ROW, dtype=jnp.uint32)
  return jnp.sum(bits, axis=1, dtype=jnp.uint32)  # distinct powers of two: the sum is their OR


def first_nonzero(masks: jax.Array, size: int, fill_value: int) -> jax.Array:
  """Positions of the first ``size`` nonzero words of ``masks``, ascending.

  What ``jnp.nonzero(masks != 0, size=size, fill_value=fill_value)`` returns,
  by a scatter of each nonzero word's position to its rank among them
  (distinct targets; the rest out of bounds and dropped). ``jnp.nonzero``
  counts ranks with a scatter-add into ``size`` bins, where every word of a
  run of empty ones adds into the same bin: a GPU serialises those atomic
  adds, and a chunk of a sparse partition is mostly such runs.

  Args:
    masks: ``[L]`` words (zero: nothing passed in that row).
    size: static number of positions.
    fill_value: the position given to slots past the last nonzero word.

  Returns:
    int32 ``[size]``.
  """
  nonzero = masks != 0
  rank = jnp.cumsum(nonzero, dtype=jnp.int32) - 1
  slot = jnp.where(nonzero, rank, size)  # size and beyond: out of bounds, dropped
  positions = jnp.arange(masks.shape[0], dtype=jnp.int32)
  return jnp.full((size,), fill_value, jnp.int32).at[slot].set(positions, mode="drop")


def nth_set_bit(masks: jax.Array, ranks: jax.Array) -> jax.Array:
  """Position of the set bit of rank ``ranks`` (0: the lowest) in each uint32 of ``masks``.

  A binary search over halves, quarters, ... of the word by population
  counts: five elementwise rounds. ``ranks`` must be below the popcount.
  """
  position = jnp.zeros_like(ranks)
  for width in (16, 8, 4, 2, 1):
    low = jax.lax.population_count(masks & jnp.uint32((1 << width) - 1)).astype(ranks.dtype)
    higher = ranks >= low
    ranks = jnp.where(higher, ranks - low, ranks)
    masks = jnp.where(higher, masks >> width, masks)
    position = position + jnp.where(higher, width, 0)
  return position


def select_in_range(
    accumulated: jax.Array,
    threshold: jax.Array,
    begin: jax.Array,
    end: jax.Array,
    *,
    capacity: int,
    chunk: int,
    unrolled: int = 0,
    fallback_offset: jax.Array | None = None,
) -> Selection:
  """The lowest ``capacity`` indices in ``[begin, end)`` with ``|a| >= threshold``.

  A loop over the range's chunks (as `count_in_range`) reads each once: it
  turns every row of 32 elements of a chunk into a bit mask of those that
  pass (`row_masks`) and keeps the first ``capacity`` non-empty rows with
  their masks. Output slot ``s`` then falls in the kept row whose running
  popcount passes ``s`` and is that row's set bit of the remaining rank
  (`nth_set_bit`): work on ``C`` words, so a high density (almost every row
  non-empty) costs no more than one pass over the range.

  Args:
    accumulated: float32 ``[N]``.
    threshold: float32 scalar.
    begin: int32 first index of the range.
    end: int32 one past its last index (``> begin``).
    capacity: static buffer size ``C``.
    chunk: static elements per iteration (see `chunk_length`).
    unrolled: static iterations unrolled on GPUs (`over_chunks`).
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
    row_starts, kept_masks, filled, passed = carry
    start, inside = chunk_window(index, begin, end, chunk)
    magnitudes = jnp.abs(jax.lax.dynamic_slice(accumulated, (start,), (chunk,)))
    masks = row_masks(inside & (magnitudes >= threshold))  # NaN passes no threshold
    rows = first_nonzero(masks, take, fill_value=num_rows)
    at = (jnp.minimum(filled, capacity),)
    row_starts = jax.lax.dynamic_update_slice(row_starts, start + rows * ROW, at)
    kept_masks = jax.lax.dynamic_update_slice(
        kept_masks, masks.at[rows].get(mode="fill", fill_value=0), at
    )
    nonempty = jnp.sum(masks != 0, dtype=jnp.int32)
    counts = jnp.sum(jax.lax.population_count(masks).astype(jnp.int32))
    return row_starts, kept_masks, filled + nonempty, passed + counts

  def loop(accumulated, threshold, begin, end):
    # Zero typed like the gradient (per worker under shard_map), so the loop
    # carry has the type the body returns even where the range is the same on
    # every worker.
    zero = jnp.zeros_like(accumulated, jnp.int32, shape=())
    row_starts = jnp.full((capacity + take,), num_elements, jnp.int32) + zero
    masks = jnp.zeros((capacity + take,), jnp.uint32) + zero.astype(jnp.uint32)
    row_starts, masks, filled, passed = over_chunks(
        num_chunks(begin, end, chunk), scan_chunk, (row_starts, masks, zero, zero),
        unrolled=unrolled)
    return row_starts[:capacity], masks[:capacity], jnp.minimum(filled, capacity), passed

  def kernel(platform):
    return functools.partial(_range_kernels.first_rows, capacity=capacity, chunk=chunk,
                             interpret=platform == "cpu")

  row_starts, masks, kept, passed = _range_kernels.on_kernel_platforms(
      kernel, loop, accumulated, threshold, begin, end)

  # Slot s of the buffer: the kept row where the running count passes s, and
  # the set bit of the rank left in that row. Rows and bits ascend, so do slots.
  masks = jnp.where(jnp.arange(capacity) < kept, masks, jnp.uint32(0))
  per_row = jax.lax.population_count(masks).astype(jnp.int32)
  row_ends = jnp.cumsum(per_row)
  slots = jnp.arange(capacity, dtype=jnp.int32)
  # Unrolled, as every search of the step: a GPU drives a loop's iterations from the host.
  row = jnp.minimum(
      jnp.searchsorted(row_ends, slots, side="right", method="scan_unrolled"), capacity - 1)
  rank = slots - (row_ends[row] - per_row[row])
  bit = nth_set_bit(masks[row], rank)
  indices = jnp.where(slots < row_ends[-1], row_starts[row] + bit, num_elements)
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


def top_k_of_rows(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-``k`` by magnitude of each row (ties towards the lower index).

  Args:
    rows: float32 ``[R, L]``.
    k: static number per row.

  Returns:
    ``(indices, values)``: int32 ``[R, k]`` positions in the row, largest
    first, and float32 ``[R, k]`` the values there.
  """
  _, indices = jax.lax.top_k(jnp.abs(rows), k)
  return indices, jnp.take_along_axis(rows, indices, axis=1)
