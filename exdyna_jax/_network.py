"""The network an exchange is priced on: what a message and a byte cost.

Two of ExDyna's choices trade bytes for messages: the spill (fewer index
bytes, one more all-reduce) and how the values are summed (a ring
all-reduce sends ``2 (n-1) / n`` of them, an all-gather ``n - 1`` times
them, in half the messages). Each is priced by the alpha-beta model below,
with the latency-optimal message counts NCCL and MPI take for small
messages: ``ceil(log2 n)`` for an all-gather and twice that for an
all-reduce.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from exdyna_jax import _collectives


class Network(NamedTuple):
  """What one message and one byte cost between two workers: ``exdyna(network=...)``.

  ExDyna trades bytes for messages twice: its spill sends fewer index bytes
  for one more all-reduce, and its values can be all-gathered (``n / 2``
  times the bytes of an all-reduce, in half the messages) and summed on
  every worker. Told the network, it prices both on it (an alpha-beta
  model with the latency-optimal message counts: ``ceil(log2 n)`` for an
  all-gather, twice that for an all-reduce). Measure it with a small and a
  large collective of your own (``benchmarks/cluster_worker.py
  --calibrate`` does).

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


NOMINAL = Network(5e-6, 25e9 / 8)
"""The reference network of ``benchmarks/scale_model.py``: 5 us a message,
25 Gb/s a worker (a message costs what 16 kB on the link do)."""


def check_network(network: Network | None) -> Network | None:
  """``network`` checked: a `Network` of positive finite numbers, or None."""
  if network is None:
    return None
  if not isinstance(network, Network):
    raise TypeError(f"network must be an exdyna_jax.Network or None, got {network!r}.")
  for name, value in network._asdict().items():
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
      raise ValueError(f"Network.{name} must be a positive finite number, got {value!r}.")
  return network


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
