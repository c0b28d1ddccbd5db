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

With a `_spill.Spill`, only the first ``head`` slots of each buffer go
through the ``all_gather`` and the rest spill into slots shared by all
workers (`_spill`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _collectives, _layout
from exdyna_jax.exchange import _spill


class SparseUpdate(NamedTuple):
  """The aggregated update of one step, as index-value pairs.

  Identical on every worker (but ``kept``). A step is applied by writing
  ``values`` at ``indices`` into zeros (the dense update) and writing
  ``kept`` (zero by default) at ``indices`` into the accumulated gradient
  (the new residual). Both writes are scatters of ``M`` elements, so the
  residual can stay in its own buffer: the error-feedback shell applies them
  after the guard's selects, which touch only these ``M`` pairs. (A density
  schedule applies each level's inside that level's branch of a
  ``lax.switch``, so that every level keeps its own ``M``; the branch's
  ``N``-sized results cost XLA a copy or two of ``N`` a step.)

  Attributes:
    indices: int32 ``[M]`` indices; the sentinel ``N`` (and anything else
      ``>= N``) is ignored; duplicates must carry equal values.
    values: float32 ``[M]`` the mean over the workers at ``indices``.
    kept: float32 ``[M]`` what this worker keeps in its residual at
      ``indices``, or None for zero (every index-union method: a transmitted
      coordinate leaves every residual). SparDL keeps what the worker itself
      dropped there on the way.
    base: float32 ``[N]`` the dense update the values are written into
      instead of zeros, or None (only a density schedule's dense level has
      one: the mean, or zeros on a skipped step).
    sent_all: bool, True where every coordinate was sent (a dense level of
      a schedule): the residual is cleared everywhere. None: never.
  """

  indices: jax.Array
  values: jax.Array
  kept: jax.Array | None = None
  base: jax.Array | None = None
  sent_all: jax.Array | None = None

  @classmethod
  def nothing(cls, like: SparseUpdate, num_elements: int, axis_name: str) -> SparseUpdate:
    """An update shaped ``like`` that writes nothing (every index the sentinel)."""
    kept = None
    if like.kept is not None:  # per worker, typed so under shard_map(check_vma=True)
      kept = _collectives.per_worker(jnp.zeros(like.kept.shape, like.kept.dtype), axis_name)
    nothing = cls(
        jnp.full(like.indices.shape, num_elements, jnp.int32),
        jnp.zeros(like.values.shape, like.values.dtype),
        kept,
    )
    if like.base is not None:
      nothing = nothing._replace(
          base=jnp.zeros(like.base.shape, like.base.dtype), sent_all=jnp.bool_(False)
      )
    return nothing

  def dense(self, num_elements: int) -> jax.Array:
    """float32 ``[N]``: ``values`` at ``indices``, ``base`` (or zero) elsewhere.

    The zeros are made from the indices (their minimum with 0, which is 0:
    indices are never negative), so that they are filled only once the
    exchange is done. A constant has no inputs, and XLA would fill its ``N``
    elements at the start of the step, while the gradient is still alive
    beside it: the step would need memory for both (on a CPU, fresh pages
    to fault in every step). XLA:CPU drops optimization barriers before it
    schedules, so a data dependence it cannot fold is what keeps the order.
    """
    if self.base is not None:
      start = self.base
    else:
      zero = jnp.min(self.indices, initial=0).astype(self.values.dtype)
      start = jnp.full((num_elements,), zero)
    return self.write(start, self.values)

  def clear(self, accumulated: jax.Array) -> jax.Array:
    """``accumulated`` (``[..., N]``) with ``kept`` (or zero) at ``indices`` (in place),
    zero everywhere where ``sent_all``."""
    cleared = self.write(accumulated, 0.0 if self.kept is None else self.kept)
    return cleared if self.sent_all is None else jnp.where(self.sent_all, 0.0, cleared)

  def write(self, target: jax.Array, updates: jax.Array | float) -> jax.Array:
    """``target`` (``[..., N]``) with ``updates`` (``[M]`` or a scalar) set at ``indices``."""
    return target.at[..., self.indices].set(updates, mode="drop")


class Exchanged(NamedTuple):
  """Result of the index-union exchange, per worker.

  Attributes:
    sparse: the `SparseUpdate`: every gathered index with the mean of all
      workers' accumulated gradients there; identical on every worker.
    gathered_indices: int32 ``[n, C]`` every worker's index buffer as it
      arrived (with a `_spill.Spill`, less what found no slot).
    gathered_info: int32 ``[n, S]`` every worker's side information.
    bytes_sent: static bytes one worker sent (`exchange_bytes` of what
      `exchange` sent): what ``stats.bytes_sent`` reports for it.
  """

  sparse: SparseUpdate
  gathered_indices: jax.Array
  gathered_info: jax.Array
  bytes_sent: int


def gather_indices(
    indices: jax.Array,
    side_info: jax.Array,
    axis_name: str,
    *,
    spill: _spill.Spill | None = None,
    num_elements: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """All-gathers every worker's index buffer with its side information.

  One ``all_gather`` moves both: the side information is appended to the
  index buffer. With ``spill``, the ``all_gather`` moves only the first
  ``spill.head`` slots (and each worker's count of indices); the indices
  past them go through the shared spill buffer, and each worker's row is put
  back together from both.

  Args:
    indices: int32 ``[C]`` this worker's chosen indices, sentinel ``N``; with
      ``spill``, every index before every sentinel (as a selection's are).
    side_info: int32 ``[S]`` small per-worker integers every worker needs.
    axis_name: the data-parallel axis.
    spill: the `_spill.Spill` layout, or None to gather the whole buffers.
    num_elements: ``N``, the sentinel (needed with ``spill``).

  Returns:
    ``(gathered_indices, gathered_info)``: int32 ``[n, C]`` and ``[n, S]``,
    row ``w`` from worker ``w``. With ``spill`` the indices that fit in
    neither part are the sentinel: the last ones of the workers whose spill
    came last.
  """
  if spill is None:
    capacity = indices.shape[0]
    buffer = jnp.concatenate([indices, side_info.astype(jnp.int32)])
    gathered = _collectives.all_gather(buffer, axis_name)
    return gathered[:, :capacity], gathered[:, capacity:]

  return _spill.gather_spilled(indices, side_info, axis_name, spill, num_elements)


def aggregate_at(
    accumulated: jax.Array,
    indices: jax.Array,
    axis_name: str,
    value_dtype: jnp.dtype = jnp.float32,
    *,
    slots: int | None = None,
    gather: bool = False,
) -> SparseUpdate:
  """Mean of all workers' accumulated gradients at ``indices`` (one ``psum``).

  With ``slots`` the indices (every worker's gathered buffers) are first
  packed into that many (`compact`), so the values' ``psum`` -- two thirds
  of an exchange's bytes -- carries the indices chosen, not the padding.
  With ``gather`` the values are all-gathered instead and every worker sums
  them itself, in worker order: the same sum (up to the order of its
  additions) in half the messages for ``n / 2`` times the bytes
  (`_network.gather_pays`).

  With a narrow ``value_dtype`` (bfloat16, float16) each worker sends its
  value divided by ``n``, rounded (and clipped to the dtype's range over
  ``n``, so the sum cannot overflow); the ``psum`` of those is the mean, and
  what the rounding and clipping took from the worker's value is ``kept`` in
  its residual. (The sum itself is formed in ``value_dtype``; its rounding is
  not kept.)

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    indices: int32 array of any shape, the same on every worker; the sentinel
      ``N`` is ignored and duplicates are harmless.
    axis_name: the data-parallel axis.
    value_dtype: the dtype the values are summed in (float32: exact as before).
    slots: static number of values summed (`compact`), or None for every index.
    gather: sum an all-gather on each worker instead of a ``psum``.

  Returns:
    The `SparseUpdate` at the flattened (packed) ``indices``.
  """
  num_workers = _collectives.axis_size(axis_name)
  flat_indices = (indices.reshape(-1) if slots is None
                  else compact(indices, slots, accumulated.shape[0]))
  values = accumulated.at[flat_indices].get(mode="fill", fill_value=0)
  narrow = jnp.dtype(value_dtype) != values.dtype
  sent = values
  if narrow:  # each worker's share of the mean, within the dtype's range over n
    limit = float(jnp.finfo(value_dtype).max) / num_workers
    sent = jnp.clip(values / num_workers, -limit, limit).astype(value_dtype)
  if gather:
    total = jnp.sum(_collectives.all_gather(sent, axis_name), axis=0, dtype=sent.dtype)
  else:
    total = jax.lax.psum(sent, axis_name)
  if not narrow:
    return SparseUpdate(flat_indices, total / num_workers)
  kept = values - num_workers * sent.astype(values.dtype)
  return SparseUpdate(flat_indices, total.astype(values.dtype), kept=kept)


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
    value_dtype: jnp.dtype = jnp.float32,
    spill: _spill.Spill | None = None,
    gather_values: bool = False,
) -> Exchanged:
  """All-gathers index buffers (and side information) and sums the values there.

  `gather_indices` followed by `aggregate_at` over the gathered indices
  (packed into ``value_slots``, if given).

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    indices: int32 ``[C]`` this worker's chosen indices, sentinel ``N``.
    side_info: int32 ``[S]`` small per-worker integers every worker needs.
    axis_name: the data-parallel axis.
    value_slots: static number of values summed, or None for all ``n C``.
    value_dtype: the dtype the values are summed in (`aggregate_at`).
    spill: gather only the buffers' heads and spill the rest (`_spill.Spill`), or
      None.
    gather_values: all-gather the values and sum them on each worker
      (`aggregate_at`'s ``gather``) instead of a ``psum``.

  Returns:
    The `Exchanged` result.

  Raises:
    ValueError: where the ``n`` gathered buffers hold ``2**31`` entries or
      more (int32 indices and counts cannot address them).
  """
  check_gathered_size(_collectives.axis_size(axis_name), indices.shape[0])
  gathered_indices, gathered_info = gather_indices(
      indices, side_info, axis_name, spill=spill, num_elements=accumulated.shape[0]
  )
  sparse = aggregate_at(accumulated, gathered_indices, axis_name, value_dtype, slots=value_slots,
                        gather=gather_values)
  bytes_sent = exchange_bytes(
      gathered_indices.shape[0], indices.shape[0], side_info.shape[0], value_slots,
      jnp.dtype(value_dtype).itemsize, spill, gather_values,
  )
  return Exchanged(sparse, gathered_indices, gathered_info, bytes_sent)


def check_gathered_size(num_workers: int, capacity: int) -> None:
  """Refuses ``n`` buffers of ``capacity`` indices that int32 cannot address together."""
  if num_workers * capacity > _layout.MAX_ELEMENTS:
    raise ValueError(
        f"{num_workers} workers would gather {num_workers} x {capacity} = "
        f"{num_workers * capacity:,} indices a step, past the {_layout.MAX_ELEMENTS:,} that int32 "
        "indices and counts address. Lower the density, send with a method whose workers "
        "select apart (exdyna, micro: n x k/n in all), or exchange this model with dense()."
    )


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
  return distinct_in_sorted(jnp.sort(indices.reshape(-1)), num_elements)


def distinct_in_sorted(ordered: jax.Array, num_elements: int) -> jax.Array:
  """`distinct_count` of int32 ``[M]`` indices already sorted ascending."""
  first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  return jnp.sum(first & (ordered < num_elements), dtype=jnp.int32)


def exchange_bytes(
    num_workers: int,
    capacity: int,
    side_info: int,
    value_slots: int | None = None,
    value_bytes: int = _collectives.VALUE_BYTES,
    spill: _spill.Spill | None = None,
    gather_values: bool = False,
) -> int:
  """Bytes one worker sends per step in `exchange`, for ring collectives.

  The index buffers' (`_spill.index_bytes`), then the values': a ring
  all-reduce of ``M`` bytes sends ``2 (n-1) / n M`` (an all-gather, with
  ``gather_values``, ``(n-1) M``), here ``value_slots`` values of
  ``value_bytes`` each, or ``n C`` without compaction.
  """
  if value_slots is None:
    value_slots = num_workers * capacity
  collective = (_collectives.ring_all_gather_bytes if gather_values
                else _collectives.ring_all_reduce_bytes)
  values = collective(num_workers, value_slots * value_bytes)
  return _spill.index_bytes(num_workers, capacity, side_info, spill) + values
