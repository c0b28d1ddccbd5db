"""The sparse exchange shared by every index-union sparsifier.

Each worker packs the indices it chose into a buffer of static capacity ``C``
(unused slots hold the sentinel ``N``, which every later step ignores). One
``all_gather`` moves the ``[n, C]`` index buffers, with any small integer side
information (such as counts) appended to them; every worker reads its
own accumulated gradient at all gathered indices and the values are summed
with one ``psum``: a `SparseUpdate`. The mean is then written with a scatter
that drops the sentinel, and every worker clears its residual at every
transmitted index.

Writing with *set* (not add) makes duplicate indices harmless: all copies of an
index carry the same summed value.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax._partition import ROW

INDEX_BYTES = 4
VALUE_BYTES = 4


def axis_size(axis_name: str) -> int:
  """Number of workers on ``axis_name``, with an error that says how to bind it."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
        f"Axis {axis_name!r} is not bound. A sparsifier's init() and update() run "
        "per worker: call them inside jax.shard_map (mesh axis "
        f"{axis_name!r}), jax.pmap(..., axis_name={axis_name!r}) or "
        f"jax.vmap(..., axis_name={axis_name!r}, axis_size=n); with plain jax.jit "
        "use exdyna_jax.data_parallel(). Or pass axis_name= to match your mesh."
    ) from None


def _is_manual(axis_name: str) -> bool:
  """True under shard_map or pmap, where collectives can return invariant values."""
  return axis_name in jax.sharding.get_abstract_mesh().manual_axes


def _tracks_varying(axis_name: str) -> bool:
  """True under ``shard_map(check_vma=True)``, whose types say what varies."""
  if not _is_manual(axis_name):
    return False
  return axis_name in jax.typeof(jax.lax.axis_index(axis_name)).manual_axis_type.varying


def check_local(grads, axis_name: str) -> None:
  """Rejects gradients that are already reduced over ``axis_name``.

  Inside ``jax.shard_map(check_vma=True)``, ``jax.grad`` with respect to
  replicated parameters returns the gradient already ``psum``-med over the
  axis: sparsifying it would compress summed gradients after the dense traffic
  was paid. The varying-axes type tells them apart.
  """
  if not _tracks_varying(axis_name):
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if axis_name not in jax.typeof(leaf).manual_axis_type.varying:
      raise ValueError(
          f"Gradient leaf {jax.tree_util.keystr(path)} is invariant over {axis_name!r}: "
          "it was already summed across workers (jax.grad of replicated params "
          "inside shard_map all-reduces the gradient densely). Differentiate a "
          f"varying copy instead: jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, "
          "to='varying'), batch), and put the sparsifier first in the chain."
      )


def per_worker(x: jax.Array, axis_name: str) -> jax.Array:
  """Marks ``x`` as varying over ``axis_name`` where the context tracks it.

  A residual starts as zeros (invariant) but becomes each worker's own after
  the first step; inside ``jax.shard_map(check_vma=True)`` a ``lax.scan`` or
  ``fori_loop`` over steps needs the carry's type to stay the same.
  """
  if not _tracks_varying(axis_name):
    return x
  return jax.lax.pcast(x, axis_name, to="varying")


FIELD_BITS = 6  # a row of 32 elements has at most 32 passing: 6 bits
FIELDS_PER_WORD = 5  # 5 x 6 bits fit an int32
MIN_CHUNK = 1 << 16  # elements per iteration of `count_in_range`, at least


def row_counts(passes: list[jax.Array]) -> jax.Array:
  """Counts, per row of 32 elements, how many elements pass each predicate.

  All predicates are counted in one pass over the vector: up to five 6-bit
  counts are packed into one int32 per element, and the packed words of all
  predicates are summed over the rows by a single reduction, so the vector
  is read once however many thresholds are probed.

  Args:
    passes: ``L`` bool ``[N]`` predicates.

  Returns:
    int32 ``[ceil(N / 32), L]`` per-row counts.
  """
  num_elements = passes[0].shape[0]
  full_rows = num_elements // ROW
  groups = [passes[i : i + FIELDS_PER_WORD] for i in range(0, len(passes), FIELDS_PER_WORD)]
  words = [sum(p.astype(jnp.int32) << (FIELD_BITS * j) for j, p in enumerate(g)) for g in groups]
  packed = jnp.stack(words, axis=-1)  # [N, words]: one reduction reads every predicate
  sums = jnp.sum(packed[: full_rows * ROW].reshape(full_rows, ROW, len(words)), axis=1)
  if full_rows * ROW < num_elements:
    sums = jnp.concatenate([sums, jnp.sum(packed[full_rows * ROW :], axis=0)[None]])
  field = (1 << FIELD_BITS) - 1
  columns = [
      (sums[:, w] >> (FIELD_BITS * j)) & field for w, g in enumerate(groups) for j in range(len(g))
  ]
  return jnp.stack(columns, axis=1)


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
    passes = [magnitudes >= thresholds[p] for p in range(thresholds.shape[0])]
    return counts + jnp.sum(row_counts(passes), axis=0), jnp.maximum(largest, jnp.max(magnitudes))

  first, last = begin // chunk, (end + chunk - 1) // chunk
  # The first chunk outside the loop gives the carry the type (and, under
  # shard_map, the varying axes) that the loop body returns.
  carry = count_chunk(first, (jnp.zeros(thresholds.shape, jnp.int32), jnp.float32(0.0)))
  return jax.lax.fori_loop(first + 1, last, count_chunk, carry)


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
    counts = row_counts([(ids >= floor) & (ids < end) & (magnitudes >= threshold)])[:, 0]
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
  carry = scan_chunk(first, (empty, empty, zero, zero))
  row_starts, row_floors, filled, passed = jax.lax.fori_loop(first + 1, last, scan_chunk, carry)

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


class SparseUpdate(NamedTuple):
  """The aggregated update of one step, as index-value pairs.

  Identical on every worker. A step is applied by writing ``values`` at
  ``indices`` into zeros (the dense update) and clearing ``indices`` in the
  accumulated gradient (the new residual). Both writes are scatters of
  ``M`` elements, so the residual can stay in its own buffer: the error-feedback
  shell applies them after the step's ``lax.cond``, which then returns only
  these ``M`` pairs and no ``N``-sized array (an ``N``-sized result of a
  ``cond`` would be copied into the donated state buffer).

  Attributes:
    indices: int32 ``[M]`` indices; the sentinel ``N`` (and anything else
      ``>= N``) is ignored; duplicates must carry equal values.
    values: float32 ``[M]`` the mean over the workers at ``indices``.
  """

  indices: jax.Array
  values: jax.Array

  @classmethod
  def nothing(cls, like: SparseUpdate, num_elements: int) -> SparseUpdate:
    """An update shaped ``like`` that writes nothing (every index the sentinel)."""
    return cls(
        jnp.full(like.indices.shape, num_elements, jnp.int32),
        jnp.zeros(like.values.shape, like.values.dtype),
    )

  def dense(self, num_elements: int) -> jax.Array:
    """float32 ``[N]``: ``values`` at ``indices``, zero elsewhere."""
    zeros = jnp.zeros((num_elements,), self.values.dtype)
    return zeros.at[self.indices].set(self.values, mode="drop")

  def clear(self, accumulated: jax.Array) -> jax.Array:
    """``accumulated`` (``[..., N]``) with every index in ``indices`` set to zero (in place)."""
    return accumulated.at[..., self.indices].set(0.0, mode="drop")


class Exchanged(NamedTuple):
  """Result of the index-union exchange, per worker.

  Attributes:
    sparse: the `SparseUpdate`: every gathered index with the mean of all
      workers' accumulated gradients there; identical on every worker.
    gathered_indices: int32 ``[n, C]`` every worker's index buffer.
    gathered_info: int32 ``[n, S]`` every worker's side information.
  """

  sparse: SparseUpdate
  gathered_indices: jax.Array
  gathered_info: jax.Array


def gather_indices(
    indices: jax.Array, side_info: jax.Array, axis_name: str
) -> tuple[jax.Array, jax.Array]:
  """All-gathers every worker's index buffer with its side information.

  One ``all_gather`` moves both: the side information is appended to the
  index buffer.

  Args:
    indices: int32 ``[C]`` this worker's chosen indices, sentinel ``N``.
    side_info: int32 ``[S]`` small per-worker integers every worker needs.
    axis_name: the data-parallel axis.

  Returns:
    ``(gathered_indices, gathered_info)``: int32 ``[n, C]`` and ``[n, S]``,
    row ``w`` from worker ``w``.
  """
  capacity = indices.shape[0]
  gathered = all_gather(jnp.concatenate([indices, side_info.astype(jnp.int32)]), axis_name)
  return gathered[:, :capacity], gathered[:, capacity:]


def all_gather(x: jax.Array, axis_name: str) -> jax.Array:
  """Every worker's ``x``, stacked ``[n, ...]`` (row ``w`` from worker ``w``).

  Identical on every worker, and typed so under ``shard_map`` (invariant), so
  what is computed from it can leave through ``out_specs=P()``;
  ``vmap(axis_name=...)`` has no invariant all-gather and gets the plain one.
  """
  if _is_manual(axis_name):
    return jax.lax.all_gather(x, axis_name, to="invarying")
  return jax.lax.all_gather(x, axis_name)


def aggregate_at(accumulated: jax.Array, indices: jax.Array, axis_name: str) -> SparseUpdate:
  """Mean of all workers' accumulated gradients at ``indices`` (one ``psum``).

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    indices: int32 array of any shape, the same on every worker; the sentinel
      ``N`` is ignored and duplicates are harmless.
    axis_name: the data-parallel axis.

  Returns:
    The `SparseUpdate` at the flattened ``indices``.
  """
  num_workers = axis_size(axis_name)
  flat_indices = indices.reshape(-1)
  values = accumulated.at[flat_indices].get(mode="fill", fill_value=0)
  return SparseUpdate(flat_indices, jax.lax.psum(values, axis_name) / num_workers)


def compact(gathered_indices: jax.Array, slots: int, num_elements: int) -> jax.Array:
  """The gathered indices, sentinels dropped, packed into ``slots`` (the same on every worker).

  Worker-major order: worker 0's indices first. Indices past ``slots`` are
  dropped (they are not exchanged, so they stay in every residual).

  Args:
    gathered_indices: int32 ``[n, C]`` every worker's index buffer.
    slots: static number of slots ``M``.
    num_elements: ``N``, the sentinel.

  Returns:
    int32 ``[M]`` indices, padded with the sentinel ``N``.
  """
  flat = gathered_indices.reshape(-1)
  valid = flat < num_elements
  position = jnp.cumsum(valid, dtype=jnp.int32) - 1
  packed = jnp.full((slots,), num_elements, jnp.int32)
  return packed.at[jnp.where(valid, position, slots)].set(flat, mode="drop")


def exchange(
    accumulated: jax.Array,
    indices: jax.Array,
    side_info: jax.Array,
    axis_name: str,
    *,
    value_slots: int | None = None,
) -> Exchanged:
  """All-gathers index buffers (and side information) and sums the values there.

  `gather_indices` followed by `aggregate_at` over the gathered indices. With
  ``value_slots`` the gathered indices are first packed into that many slots
  (`compact`), so the value ``psum`` -- two thirds of the bytes -- carries
  the indices actually chosen, not every worker's padding.

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    indices: int32 ``[C]`` this worker's chosen indices, sentinel ``N``.
    side_info: int32 ``[S]`` small per-worker integers every worker needs.
    axis_name: the data-parallel axis.
    value_slots: static number of values summed, or None for all ``n C``.

  Returns:
    The `Exchanged` result.
  """
  gathered_indices, gathered_info = gather_indices(indices, side_info, axis_name)
  reduced = gathered_indices
  if value_slots is not None:
    reduced = compact(gathered_indices, value_slots, accumulated.shape[0])
  sparse = aggregate_at(accumulated, reduced, axis_name)
  return Exchanged(sparse, gathered_indices, gathered_info)


def broadcast_from(x: jax.Array, source: jax.Array, axis_name: str) -> jax.Array:
  """Worker ``source``'s ``x`` on every worker, as one integer ``psum``.

  Every other worker contributes zeros. A ring all-reduce of ``M`` bytes
  sends ``2 (n-1) / n M`` per worker, less than the ``(n-1) M`` of gathering
  every worker's copy to keep one.

  Args:
    x: int32 array (integers add exactly).
    source: int32 scalar rank of the worker whose ``x`` is kept.
    axis_name: the data-parallel axis.

  Returns:
    ``x`` of worker ``source``, identical on every worker.
  """
  mine = jax.lax.axis_index(axis_name) == source
  return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis_name)


def distinct_count(indices: jax.Array, num_elements: int) -> jax.Array:
  """Number of distinct indices below ``num_elements`` (the sentinel is ignored).

  Sorts the ``M`` indices instead of marking an ``[N]`` vector, so it costs
  ``O(M log M)``, independent of ``N``.

  Args:
    indices: int32 array of any shape, e.g. gathered ``[n, C]`` buffers.
    num_elements: ``N``, the sentinel.

  Returns:
    int32 scalar: the size of ``unique(indices)`` without the sentinel.
  """
  ordered = jnp.sort(indices.reshape(-1))
  first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  return jnp.sum(first & (ordered < num_elements), dtype=jnp.int32)


def ring_all_gather_bytes(num_workers: int, message_bytes: int) -> int:
  """Bytes one worker sends in a ring all-gather of ``M`` bytes per worker: ``(n-1) M``."""
  return (num_workers - 1) * message_bytes


def ring_all_reduce_bytes(num_workers: int, message_bytes: int) -> int:
  """Bytes one worker sends in a ring all-reduce of ``M`` bytes: ``2 (n-1) / n M``."""
  return 2 * (num_workers - 1) * message_bytes // num_workers


def exchange_bytes(
    num_workers: int, capacity: int, side_info: int, value_slots: int | None = None
) -> int:
  """Bytes one worker sends per step in `exchange`, for ring collectives.

  A ring all-gather of ``M`` bytes per worker sends ``(n-1) M``; a ring
  all-reduce of ``M`` bytes sends ``2 (n-1) / n M``. The values all-reduced are
  ``value_slots`` floats, or ``n C`` without compaction.
  """
  if value_slots is None:
    value_slots = num_workers * capacity
  gather = ring_all_gather_bytes(num_workers, (capacity + side_info) * INDEX_BYTES)
  reduce = ring_all_reduce_bytes(num_workers, value_slots * VALUE_BYTES)
  return gather + reduce


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


def float_bits(x: jax.Array) -> jax.Array:
  """The bits of a float32 as an int32, to ride on an integer collective."""
  return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def bits_float(x: jax.Array) -> jax.Array:
  """Inverse of `float_bits`. On non-negative floats both orders agree."""
  return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.int32), jnp.float32)
