"""The network an exchange is priced on: what a message and a byte cost.

Three of ExDyna's choices trade bytes for messages: the spill (fewer index
bytes, one more all-reduce), how the values are summed (a ring all-reduce
sends ``2 (n-1) / n`` of them, an all-gather ``n - 1`` times them, in half
the messages) and whether the probe counts ride the index buffers (the
magnitudes added, one all-gather fewer: `_early_selection`). Each is
priced by the alpha-beta model below, with the latency-optimal message
counts NCCL and MPI take for small messages: ``ceil(log2 n)`` for an
all-gather and twice that for an all-reduce. `Network.measure` fits that
model to two all-gathers timed on the user's mesh.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from exdyna_jax.core import _collectives, _options


class Network(NamedTuple):
  """What one message and one byte cost between two workers: ``exdyna(network=...)``.

  ExDyna trades bytes for messages three times: its spill sends fewer
  index bytes for one more all-reduce, its values can be all-gathered
  (``n / 2`` times the bytes of an all-reduce, in half the messages) and
  summed on every worker, and its probe counts can ride its index buffers
  (with the ``C`` magnitudes in them: one all-gather fewer). Told the
  network, it prices each on it (an alpha-beta
  model with the latency-optimal message counts: ``ceil(log2 n)`` for an
  all-gather, twice that for an all-reduce). `Network.measure` times it on
  your mesh.

  Attributes:
    message_seconds: the latency of one message (alpha): about 5e-6 on a
      datacenter network with RDMA, about 1e-3 for gloo over TCP between
      processes (the emulated cluster of :doc:`/multihost`).
    bytes_per_second: one worker's link (1 / beta): ``25e9 / 8`` at 25 Gb/s.

  Example:

    >>> import exdyna_jax
    >>> gloo_at_1gbit = exdyna_jax.Network(message_seconds=1e-3, bytes_per_second=1e9 / 8)
    >>> tx = exdyna_jax.exdyna(0.001, network=gloo_at_1gbit)
  """

  message_seconds: float
  bytes_per_second: float

  @classmethod
  def measure(cls, mesh: jax.sharding.Mesh, axis_name: str = "data", *,
              repeats: int = 5) -> Network:
    """The `Network` between the workers along ``axis_name`` of ``mesh``, timed.

    Times an all-gather of `SMALL_MESSAGE_BYTES` and one of
    `LARGE_MESSAGE_BYTES` a worker over the axis (the median of ``repeats``
    each, after one that compiles) and fits the model the choices are
    priced on: ``ceil(log2 n)`` messages and ``(n - 1)`` times the bytes a
    worker sends. Call it on every process, where the mesh spans several
    (it runs collectives); each process gets the slowest process's
    figures, so all of them plan the same step.

    Args:
      mesh: the mesh the training step runs on.
      axis_name: its data-parallel axis (the sparsifier's ``axis_name``).
      repeats: timed all-gathers of each size.

    Returns:
      The measured `Network`.

    Raises:
      ValueError: if ``mesh`` has no axis ``axis_name``, or it has one
        worker (there is no network to time), or ``repeats`` is below 1.
    """
    if axis_name not in mesh.shape:
      raise ValueError(f"Network.measure: the mesh has no axis {axis_name!r} (its axes: "
                       f"{tuple(mesh.shape)}); pass axis_name= to name the data axis.")
    repeats = _options.check_positive_int(repeats, "repeats", "timed all-gathers of each size")
    num_workers = mesh.shape[axis_name]
    if num_workers < 2:
      raise ValueError(
          f"Network.measure needs two or more workers along {axis_name!r}; the mesh "
          f"{dict(mesh.shape)} has {num_workers}.")
    seconds = [_all_gather_seconds(mesh, axis_name, size, repeats)
               for size in (SMALL_MESSAGE_BYTES, LARGE_MESSAGE_BYTES)]
    slowest = np.max(multihost_utils.process_allgather(np.asarray(seconds)), axis=0)
    return cls(*fit_network(num_workers, *slowest))


SMALL_MESSAGE_BYTES = 256  # what `Network.measure` times: one all-gather of each, a worker
LARGE_MESSAGE_BYTES = 4 << 20

NOMINAL = Network(5e-6, 25e9 / 8)
"""The reference network of ``benchmarks/scale_model.py``: 5 us a message,
25 Gb/s a worker (a message costs what 16 kB on the link do)."""


def _all_gather_seconds(mesh: jax.sharding.Mesh, axis_name: str, size_bytes: int,
                        repeats: int) -> float:
  """Median seconds of an all-gather of ``size_bytes`` a worker over ``axis_name``."""
  num_workers = mesh.shape[axis_name]
  words = size_bytes // _collectives.INDEX_BYTES
  sharding = jax.sharding.NamedSharding(mesh, jax.P(axis_name))
  host = np.zeros(num_workers * words, np.int32)
  values = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  gather = jax.jit(jax.shard_map(
      lambda x: jax.lax.all_gather(x, axis_name, tiled=True), mesh=mesh,
      in_specs=jax.P(axis_name), out_specs=jax.P(axis_name), check_vma=False))
  jax.block_until_ready(gather(values))
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(gather(values))
    seconds.append(time.perf_counter() - start)
  return float(np.median(seconds))


def fit_network(num_workers: int, small_seconds: float, large_seconds: float) -> Network:
  """The `Network` whose all-gathers of the two measured sizes take these seconds.

  ``t(S) = ceil(log2 n) alpha + (n - 1) S / B`` through both points; where
  the large one is not the slower (noise) or the small one is all bytes,
  alpha and B are kept positive: B from the large one alone, alpha no
  smaller than a nanosecond.
  """
  messages = math.ceil(math.log2(num_workers))
  extra_bytes = (num_workers - 1) * (LARGE_MESSAGE_BYTES - SMALL_MESSAGE_BYTES)
  if large_seconds > small_seconds:
    bytes_per_second = extra_bytes / (large_seconds - small_seconds)
  else:
    bytes_per_second = (num_workers - 1) * LARGE_MESSAGE_BYTES / large_seconds
  small_bytes_seconds = (num_workers - 1) * SMALL_MESSAGE_BYTES / bytes_per_second
  message_seconds = max((small_seconds - small_bytes_seconds) / messages, 1e-9)
  return Network(float(message_seconds), float(bytes_per_second))


def check_network(network: Network | None) -> Network | None:
  """``network`` checked: a `Network` of positive finite numbers, or None."""
  if network is None:
    return None
  if not isinstance(network, Network):
    raise TypeError(f"network must be an exdyna_jax.Network or None, got {network!r}.")
  return Network(
      _options.check_positive_finite(network.message_seconds, "Network.message_seconds",
                                     "seconds a message takes"),
      _options.check_positive_finite(network.bytes_per_second, "Network.bytes_per_second",
                                     "one worker's link"),
  )


def all_reduce_seconds(network: Network, num_workers: int, size_bytes: int) -> float:
  """Alpha-beta seconds of an all-reduce of ``size_bytes`` over ``n`` workers."""
  messages = 2 * math.ceil(math.log2(num_workers))
  sent = _collectives.ring_all_reduce_bytes(num_workers, size_bytes)
  return messages * network.message_seconds + sent / network.bytes_per_second


def all_gather_seconds(network: Network, num_workers: int, size_bytes: int) -> float:
  """Alpha-beta seconds of an all-gather of ``size_bytes`` from each of ``n`` workers."""
  messages = math.ceil(math.log2(num_workers))
  sent = _collectives.ring_all_gather_bytes(num_workers, size_bytes)
  return messages * network.message_seconds + sent / network.bytes_per_second


def gather_pays(network: Network, num_workers: int, size_bytes: int) -> bool:
  """Whether all-gathering ``size_bytes`` a worker and summing them locally beats an all-reduce.

  It sends ``n / 2`` times the bytes in half the messages: it pays on two
  workers always (the same bytes), and elsewhere where messages are dear
  and the values few.
  """
  return (all_gather_seconds(network, num_workers, size_bytes)
          < all_reduce_seconds(network, num_workers, size_bytes))
