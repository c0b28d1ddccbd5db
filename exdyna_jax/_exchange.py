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

from collections.abc import Callable
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
) -> jax.Array:
  """Elements of ``accumulated[begin:end]`` with ``|a| >= t``, for each threshold ``t``.

  A loop over the chunks of ``chunk`` elements that overlap ``[begin, end)``
  reads each of them once and counts all thresholds (`row_counts`), so the
  cost follows the length of the range, not a static bound on it.

  Args:
    accumulated: float32 ``[N]``.
    begin: int32 first index of the range.
    end: int32 one past its last index.
    thresholds: float32 ``[P]`` (``P`` static).
    chunk: static elements per iteration (see `chunk_length`).

  Returns:
    int32 ``[P]`` counts.
  """
  num_elements = accumulated.shape[0]
  chunk = min(chunk, num_elements)

  def count_chunk(index, counts):
    nominal = index * chunk
    start = jnp.minimum(nominal, num_elements - chunk)  # the last chunk shifts left to fit
    ids = start + jnp.arange(chunk, dtype=jnp.int32)
    # From the nominal start only: a shifted last chunk overlaps the one before.
    inside = (ids >= jnp.maximum(begin, nominal)) & (ids < end)
    # Outside the range a magnitude of -1 passes no threshold (NaN passes none either).
    magnitudes = jnp.where(
        inside, jnp.abs(jax.lax.dynamic_slice(accumulated, (start,), (chunk,))), -1.0
    )
    passes = [magnitudes >= thresholds[p] for p in range(thresholds.shape[0])]
    return counts + jnp.sum(row_counts(passes), axis=0)

  first, last = begin // chunk, (end + chunk - 1) // chunk
  # The first chunk outside the loop gives the carry the type (and, under
  # shard_map, the varying axes) that the loop body returns.
  counts = count_chunk(first, jnp.zeros(thresholds.shape, jnp.int32))
  return jax.lax.fori_loop(first + 1, last, count_chunk, counts)


def compact_rows(
    counts_per_row: jax.Array,
    is_set: Callable[[jax.Array], jax.Array],
    capacity: int,
    num_elements: int,
) -> jax.Array:
  """Indices of the first ``capacity`` set elements, from per-row counts.

  The first ``capacity`` non-empty rows are found with a prefix sum over the
  ``N / 32`` row counts only; the ``capacity x 32`` elements of those rows are
  then compacted. The first ``capacity`` set elements always lie in the first
  ``capacity`` non-empty rows.

  Args:
    counts_per_row: int32 ``[ceil(N / 32)]`` set elements per row.
    is_set: maps int32 element indices (any shape, all ``< N``) to whether
      they are set.
    capacity: static number of slots ``C``.
    num_elements: ``N``, also the sentinel.

  Returns:
    int32 ``[C]`` ascending indices, padded with the sentinel ``N``.
  """
  num_rows = counts_per_row.shape[0]
  (row_ids,) = jnp.nonzero(counts_per_row > 0, size=min(capacity, num_rows), fill_value=num_rows)
  element_ids = row_ids[:, None] * ROW + jnp.arange(ROW, dtype=jnp.int32)
  valid = element_ids < num_elements
  picked = valid & is_set(jnp.where(valid, element_ids, 0))
  per_row = jnp.sum(picked, axis=1, dtype=jnp.int32)
  row_offsets = jnp.cumsum(per_row) - per_row
  rank_in_row = jnp.cumsum(picked, axis=1, dtype=jnp.int32) - 1
  slots = jnp.where(picked, row_offsets[:, None] + rank_in_row, capacity)
  indices = jnp.full((capacity,), num_elements, jnp.int32)
  return indices.at[slots.reshape(-1)].set(element_ids.reshape(-1), mode="drop")


class Window(NamedTuple):
  """A contiguous range of the accumulated gradient that a selection scans.

  Selecting inside a partition only needs the partition, so the scan, the
  prefix sums and the compaction run on a static-size range that holds it:
  their cost grows with the partition (about ``N / n``), not with ``N``. The
  range is read in place (a ``dynamic_slice`` that XLA fuses into the scan),
  never copied out.

  Attributes:
    accumulated: float32 ``[N]`` the whole vector.
    offset: int32 global index of the window's first element.
    length: static number of elements ``W``.
  """

  accumulated: jax.Array
  offset: jax.Array
  length: int

  @classmethod
  def whole(cls, accumulated: jax.Array) -> Window:
    """The whole vector as a window."""
    return cls(accumulated, jnp.int32(0), accumulated.shape[0])

  @classmethod
  def around(cls, accumulated: jax.Array, begin: jax.Array, length: int) -> Window:
    """The ``length`` elements from ``begin`` (shifted left to fit inside ``N``)."""
    offset = jnp.clip(begin, 0, accumulated.shape[0] - length).astype(jnp.int32)
    return cls(accumulated, offset, length)

  @property
  def num_elements(self) -> int:
    """``N``, the length of the whole vector (and the sentinel)."""
    return self.accumulated.shape[0]

  def scan(self, begin, end, threshold) -> jax.Array:
    """bool ``[W]``: which window elements lie in ``[begin, end)`` with ``|a| >= threshold``.

    Elementwise over the window read in place: XLA fuses the slice into
    whatever consumes the result.
    """
    global_ids = self.offset + jnp.arange(self.length, dtype=jnp.int32)
    values = jax.lax.dynamic_slice(self.accumulated, (self.offset,), (self.length,))
    return (global_ids >= begin) & (global_ids < end) & (jnp.abs(values) >= threshold)

  def passes(self, begin, end, threshold) -> Callable[[jax.Array], jax.Array]:
    """``local ids -> begin <= global id < end and |value| >= threshold``, by a gather.

    For a few elements (the rows that `compact_rows` picks); `scan` reads the
    whole window.
    """

    def passes(ids):
      global_ids = self.offset + ids
      values = self.accumulated[global_ids]
      return (global_ids >= begin) & (global_ids < end) & (jnp.abs(values) >= threshold)

    return passes


class Selection(NamedTuple):
  """What one worker chose this step.

  Attributes:
    indices: int32 ``[C]`` chosen indices, sentinel ``N`` in unused slots.
    passed: int32 number of elements that passed the threshold (before
      capacity).
    sent: int32 ``|I_w|`` as the reference counts it: ``passed``, or 1 when
      the fallback index was sent.
  """

  indices: jax.Array
  passed: jax.Array
  sent: jax.Array


def select_window(
    window: Window,
    threshold: jax.Array,
    begin: jax.Array,
    end: jax.Array,
    *,
    capacity: int,
    fallback_offset: jax.Array | None = None,
) -> Selection:
  """Selects ``|a| >= threshold`` inside ``[begin, end)``.

  One pass over the window counts the passing elements per row of 32; the
  prefix sums and the compaction then work on row counts and on the few
  non-empty rows only.

  Args:
    window: a `Window` that holds ``[begin, end)``.
    threshold: float32 scalar.
    begin: int32 first global index of the range.
    end: int32 one past its last global index.
    capacity: static buffer size ``C``.
    fallback_offset: if given and nothing passes, index
      ``begin + fallback_offset mod (end - begin)`` is sent alone (so every
      worker always sends something, as the reference does).

  Returns:
    The `Selection`, with global indices.
  """
  counts = row_counts([window.scan(begin, end, threshold)])[:, 0]
  passed = jnp.sum(counts)
  local = compact_rows(counts, window.passes(begin, end, threshold), capacity, window.length)
  indices = jnp.where(local < window.length, local + window.offset, window.num_elements)
  sent = passed
  if fallback_offset is not None:
    nothing = passed == 0
    fallback = begin + fallback_offset % (end - begin)
    indices = indices.at[0].set(jnp.where(nothing, fallback, indices[0]))
    sent = jnp.where(nothing, 1, passed)
  return Selection(indices, passed, sent)


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
  payload = jnp.concatenate([indices, side_info.astype(jnp.int32)])
  if _is_manual(axis_name):
    gathered = jax.lax.all_gather(payload, axis_name, to="invarying")
  else:  # vmap(axis_name=...) has no invariant all_gather
    gathered = jax.lax.all_gather(payload, axis_name)
  return gathered[:, :capacity], gathered[:, capacity:]


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


def exchange(
    accumulated: jax.Array, indices: jax.Array, side_info: jax.Array, axis_name: str
) -> Exchanged:
  """All-gathers index buffers (and side information) and sums the values there.

  `gather_indices` followed by `aggregate_at` over the gathered indices.

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    indices: int32 ``[C]`` this worker's chosen indices, sentinel ``N``.
    side_info: int32 ``[S]`` small per-worker integers every worker needs.
    axis_name: the data-parallel axis.

  Returns:
    The `Exchanged` result.
  """
  gathered_indices, gathered_info = gather_indices(indices, side_info, axis_name)
  sparse = aggregate_at(accumulated, gathered_indices, axis_name)
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


def exchange_bytes(num_workers: int, capacity: int, side_info: int) -> int:
  """Bytes one worker sends per step in `exchange`, for ring collectives.

  A ring all-gather of ``M`` bytes per worker sends ``(n-1) M``; a ring
  all-reduce of ``M`` bytes sends ``2 (n-1) / n M``. The values all-reduced are
  ``n C`` floats.
  """
  gather = ring_all_gather_bytes(num_workers, (capacity + side_info) * INDEX_BYTES)
  reduce = ring_all_reduce_bytes(num_workers, num_workers * capacity * VALUE_BYTES)
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
