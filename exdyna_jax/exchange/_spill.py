"""The spill: index buffers whose heads are all-gathered and whose tails share slots.

With a `Spill`, only the first ``head`` slots of each index buffer go through
the ``all_gather`` (with each worker's count); the rest of every worker's
indices are packed end to end into one buffer shared by all workers and
summed with an int32 ``psum`` (`_collectives.concatenate_ragged`). Index
slots are then paid for where the selections are, not in every worker's
padding: a worker whose count swings far above ``k / n`` (on some steps,
rarely several workers at once) borrows the slots the others left. The price
is one more collective per step; `choose_spill` takes it where it pays.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _collectives
from exdyna_jax.exchange import _network


class Spill(NamedTuple):
  """How index buffers of ``C`` slots travel when only their heads are all-gathered.

  Attributes:
    head: index slots per worker in the ``all_gather`` (``< C``).
    slots: slots of the buffer shared by all workers that the rest of each
      worker's indices spill into, one worker after the other (one int32
      ``psum``); what does not fit is not sent.
  """

  head: int
  slots: int


# With the adaptive controller only the head of each index buffer is
# all-gathered, SPILL_HEAD k / n slots; the rest spills into slots shared by
# all workers (`Spill`): room for one worker's whole tail, and at
# least SPILL_SHARE k. A worker's count swings far above k / n on some
# steps, but rarely several workers' at once.
SPILL_HEAD = 1.2
SPILL_SHARE = 0.3


def default_spill(target: int, capacity: int, num_workers: int) -> Spill | None:
  """How buffers of ``capacity`` slots are sent with the adaptive controller.

  Args:
    target: ``k``.
    capacity: ``C``, index slots per worker.
    num_workers: ``n``.

  Returns:
    A `Spill` of ``H = ceil(SPILL_HEAD k / n)`` gathered slots per
    worker and ``P = max(ceil(SPILL_SHARE k), C - H)`` shared ones; or None
    where that would not send fewer bytes than gathering whole buffers (a
    ring all-reduce of ``P`` slots costs ``2 P / n`` gathered slots per
    worker, so where ``2 P >= n (C - H)``: on 2 workers, or for ``C = 1.5 k / n``).
  """
  head = math.ceil(SPILL_HEAD * target / num_workers)
  tail = capacity - head
  slots = max(math.ceil(SPILL_SHARE * target), tail)
  if 2 * slots >= num_workers * tail:
    return None
  return Spill(head, slots)


def choose_spill(
    spill: bool | None, target: int, capacity: int, num_workers: int,
    network: _network.Network = _network.NOMINAL,
) -> Spill | None:
  """The `Spill` of the adaptive controller's exchange, as ``exdyna(spill=...)`` asks.

  Args:
    spill: True: `default_spill` wherever it sends fewer bytes; False:
      never; None: where it also `spill_pays` on ``network``.
    target: ``k``.
    capacity: ``C``, index slots per worker.
    num_workers: ``n``.
    network: what the spill is priced on (`_network.NOMINAL` unless the user says).

  Returns:
    The layout, or None for whole buffers.
  """
  if spill is False:
    return None
  layout = default_spill(target, capacity, num_workers)
  if (spill is None and layout is not None
      and not spill_pays(layout, capacity, num_workers, network)):
    return None
  return layout


def spill_pays(spill: Spill, capacity: int, num_workers: int,
               network: _network.Network = _network.NOMINAL) -> bool:
  """Whether ``spill`` makes a step's exchange faster on ``network``.

  The spill sends fewer bytes than whole buffers, for one more collective:
  an all-reduce of ``2 ceil(log2 n)`` messages at the least (the
  latency-optimal algorithm NCCL and MPI take for small messages). It pays
  where the bytes it saves take longer on the link than those messages'
  latency: on `_network.NOMINAL` (5 us a message, 25 Gb/s) at large ``k``
  (on 8 workers from about ``d = 0.01`` of ``N = 11.2M``), not at small ``k``.

  Args:
    spill: the layout `default_spill` gives.
    capacity: ``C``, index slots per worker.
    num_workers: ``n``.
    network: what a message and a byte cost.

  Returns:
    True where the spill is the faster exchange.
  """
  whole = index_bytes(num_workers, capacity, side_info=0)
  spilled = index_bytes(num_workers, capacity, side_info=0, spill=spill)
  saved_seconds = (whole - spilled) / network.bytes_per_second
  # The extra round's latency (its bytes are in ``spilled``).
  return saved_seconds > _network.all_reduce_seconds(network, num_workers, 0)


def gather_spilled(
    indices: jax.Array, side_info: jax.Array, axis_name: str, spill: Spill, num_elements: int
) -> tuple[jax.Array, jax.Array]:
  """`_exchange.gather_indices` with a spill: heads all-gathered, tails through shared slots.

  Args:
    indices: int32 ``[C]`` this worker's chosen indices, sentinel ``N``, every
      index before every sentinel (as a selection's are).
    side_info: int32 ``[S]`` small per-worker integers every worker needs.
    axis_name: the data-parallel axis.
    spill: the layout.
    num_elements: ``N``, the sentinel.

  Returns:
    ``(gathered_indices, gathered_info)``: int32 ``[n, C]`` and ``[n, S]``,
    row ``w`` from worker ``w``; the indices that fit in neither part are
    the sentinel (the last ones of the workers whose spill came last).
  """
  capacity, head = indices.shape[0], spill.head
  count = jnp.sum(indices < num_elements, dtype=jnp.int32)
  buffer = jnp.concatenate([indices[:head], side_info.astype(jnp.int32), count[None]])
  gathered = _collectives.all_gather(buffer, axis_name)
  heads, gathered_info, counts = gathered[:, :head], gathered[:, head:-1], gathered[:, -1]
  spilled = jnp.maximum(counts - head, 0)
  shared, offsets = _collectives.concatenate_ragged(
      indices[head:], spilled, spill.slots, axis_name
  )
  rank = jnp.arange(capacity - head, dtype=jnp.int32)
  tails = shared.at[offsets[:, None] + rank].get(mode="fill", fill_value=-1)
  tails = jnp.where((rank < spilled[:, None]) & (tails >= 0), tails, num_elements)
  return jnp.concatenate([heads, tails], axis=1), gathered_info


def index_bytes(num_workers: int, capacity: int, side_info: int, spill: Spill | None = None
                ) -> int:
  """Bytes one worker sends to gather the index buffers, for ring collectives.

  A ring all-gather of ``M`` bytes per worker sends ``(n-1) M``, a ring
  all-reduce of ``M`` bytes ``2 (n-1) / n M``. Whole buffers: an all-gather
  of ``C`` indices and ``S`` side integers; with ``spill``, of ``head``
  indices, a count and the side integers, then an all-reduce of the shared
  slots.
  """
  gathered_slots, shared_slots = capacity, 0
  if spill is not None:
    gathered_slots, shared_slots = spill.head + 1, spill.slots
  gathered_bytes = (gathered_slots + side_info) * _collectives.INDEX_BYTES
  gather = _collectives.ring_all_gather_bytes(num_workers, gathered_bytes)
  shared = _collectives.ring_all_reduce_bytes(
      num_workers, shared_slots * _collectives.INDEX_BYTES)
  return gather + shared
