"""Selection before the threshold: the probe counts ride the index buffers.

The adaptive controller needs every worker's count curve before it can set
the global threshold, and the selection needs the threshold: two rounds
(`_threshold.measure_partitions`, then `_exchange.gather_indices`). Where a
message costs more than a few kilobytes on the link, one round does: each
worker counts its partition at the probes, selects *before* the threshold
is known, at its *floor* (the lowest probe whose count fits its ``C``
buffer slots), and all-gathers its counts, its largest magnitude, its
buffer and the magnitudes in it together (`gather_candidates`). Every
worker then sets the threshold from the counts, as before, and keeps the
buffered indices that pass it (`keep_passing`).

Where the threshold is at or above every worker's floor, and each floor's
count fits (`holds_every_pass`), every buffer holds all that passes in its
partition: what is kept is exactly what selecting at the threshold sends.
A step where it is not (the threshold fell below a floor, or no probe's
count fits a buffer: the first step, a jump of the gradient scale) selects
again at the threshold and gathers the buffers again, as the two-round
exchange does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _collectives
from exdyna_jax.exchange import _exchange, _network
from exdyna_jax.selection import _selection, _threshold

SELECTED_AGAIN_SCOPE = "selected_again"  # names, in the HLO, what only a second selection runs
# Each worker's buffer carries, besides its C indices and C magnitudes, its
# floor and its fallback index (then its `_threshold.probe_row`).
SIDE_WORDS = 2


def pays(network: _network.Network, num_workers: int, capacity: int, num_probes: int) -> bool:
  """Whether one all-gather of the counts and the buffers beats one of each on ``network``.

  The merged one carries, besides the ``P + 1`` control words and the ``C``
  indices, the ``C`` magnitudes and `SIDE_WORDS` (the floor and the fallback
  index) instead of the pass count: ``C + 1`` words more, one all-gather's
  messages fewer.
  """
  words = _collectives.INDEX_BYTES
  control, buffers = (num_probes + 1) * words, (capacity + 1) * words
  separate = (_network.all_gather_seconds(network, num_workers, control)
              + _network.all_gather_seconds(network, num_workers, buffers))
  merged = _network.all_gather_seconds(
      network, num_workers, control + (2 * capacity + SIDE_WORDS) * words)
  return merged < separate


class Candidates(NamedTuple):
  """Every worker's probe counts and buffer, after the one all-gather.

  Attributes:
    probe: the `_threshold.ProbeCounts` the controller sets the threshold
      from.
    indices: int32 ``[n, C]`` each worker's buffer: its partition's lowest
      ``C`` indices with ``|a|`` at or above its floor, sentinel ``N``.
    magnitudes: float32 ``[n, C]`` ``|a|`` at those indices on their worker
      (0 at the sentinel).
    floors: float32 ``[n]`` the threshold each worker selected at.
    fallbacks: int32 ``[n]`` the index each worker sends when nothing it
      holds passes (`_selection.select_in_range`'s ``fallback_offset``).
  """

  probe: _threshold.ProbeCounts
  indices: jax.Array
  magnitudes: jax.Array
  floors: jax.Array
  fallbacks: jax.Array


def floor_of(thresholds: jax.Array, counts: jax.Array, capacity: int) -> jax.Array:
  """The lowest of the ascending ``thresholds`` whose count fits ``capacity`` (else the highest)."""
  fits = jnp.argmax(counts <= capacity)  # counts do not increase: the first that fits
  return thresholds[jnp.where(counts[-1] <= capacity, fits, counts.shape[0] - 1)]


def gather_candidates(
    accumulated: jax.Array, previous: jax.Array, begin: jax.Array, end: jax.Array, *,
    capacity: int, chunk: int, unrolled: int, fallback_offset: jax.Array, axis_name: str,
) -> Candidates:
  """Counts the partition at the probes, selects at the floor, and all-gathers both.

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    previous: float32 the last step's threshold (the probes lie around it).
    begin: int32 first index of this worker's partition.
    end: int32 one past its last index.
    capacity: static buffer slots ``C``.
    chunk: static elements per iteration (`_selection.chunk_length`).
    unrolled: static iterations unrolled on GPUs (`_selection.over_chunks`).
    fallback_offset: int32 where in the partition the fallback index lies.
    axis_name: the data-parallel axis.

  Returns:
    The `Candidates`, the same on every worker.
  """
  thresholds = _threshold.probe_thresholds(previous)
  counts, largest = _selection.count_in_range(
      accumulated, begin, end, thresholds, chunk=chunk, unrolled=unrolled)
  floor = floor_of(thresholds, counts, capacity)
  selection = _selection.select_in_range(
      accumulated, floor, begin, end, capacity=capacity, chunk=chunk, unrolled=unrolled)
  magnitudes = jnp.abs(accumulated.at[selection.indices].get(mode="fill", fill_value=0))
  fallback = begin + fallback_offset % (end - begin)
  side_info = jnp.concatenate([
      _collectives.float_bits(magnitudes), _collectives.float_bits(floor)[None], fallback[None],
      _threshold.probe_row(counts, largest)])
  indices, info = _exchange.gather_indices(selection.indices, side_info, axis_name)
  return Candidates(
      probe=_threshold.gathered_probe(info[:, capacity + SIDE_WORDS:]),
      indices=indices,
      magnitudes=_collectives.bits_float(info[:, :capacity]),
      floors=_collectives.bits_float(info[:, capacity]),
      fallbacks=info[:, capacity + 1],
  )


def holds_every_pass(candidates: Candidates, threshold: jax.Array, capacity: int) -> jax.Array:
  """Whether every worker's buffer holds all of its partition that passes ``threshold``.

  It does where the threshold is at or above the worker's floor and the
  floor's count fits the ``C`` slots; then `keep_passing` is exactly what
  selecting at the threshold would have sent.
  """
  fits = jnp.min(candidates.probe.counts, axis=1) <= capacity  # the highest probe's count
  return jnp.all(fits & (threshold >= candidates.floors))


def keep_passing(candidates: Candidates, threshold: jax.Array, num_elements: int
                 ) -> tuple[jax.Array, jax.Array]:
  """Each worker's buffered indices that pass ``threshold``, and how many pass.

  A worker that holds nothing passing sends its fallback index alone.

  Args:
    candidates: the gathered `Candidates`.
    threshold: float32 the step's threshold.
    num_elements: ``N``, the sentinel.

  Returns:
    ``(indices, passed)``: int32 ``[n, C]`` (sentinel ``N``) and ``[n]``.
  """
  passes = candidates.magnitudes >= threshold
  indices = jnp.where(passes, candidates.indices, num_elements)
  passed = jnp.sum(passes, axis=1, dtype=jnp.int32)
  fallback = jnp.where(passed == 0, candidates.fallbacks, indices[:, 0])
  return indices.at[:, 0].set(fallback), passed
