"""An all-reduce of every element in ``b`` bits: a quantized reduce-scatter, then an all-gather.

Gathering every worker's ``b``-bit message costs each worker ``(n - 1)``
messages of the whole vector. An all-reduce costs two passes over ``1 /
n`` of it each: the chunks are cut into ``n`` contiguous shards, one owned
by each worker; every worker sends each owner its chunks of the owner's
shard in ``b`` bits (one ``all_to_all``), the owner takes the mean of what
it received, adds what its own rounding of that shard lost before, and
sends the mean back in ``b'`` bits (one ``all_gather``), keeping what this
second rounding loses. Each worker sends ``(n - 1) / n`` of a whole
message in each pass, not ``n - 1`` messages.

Both roundings are error-fed: the worker keeps what its own values lost
(the caller's residual), and the owner what the mean lost (its shard
residual), which enters the next mean, so nothing is lost between them.
That is 1-bit Adam's compressed all-reduce (DoubleSqueeze's two-pass error
compensation) on this package's compact wire (`_packed`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _collectives
from exdyna_jax.exchange import _packed


class QuantizedMean(NamedTuple):
  """One quantized all-reduce, as this worker sees it.

  Attributes:
    mean: float32 ``[n, c, L]`` the workers' mean as the second pass
      carries it, the same on every worker.
    own: float32 ``[n, c, L]`` this worker's values as the first pass
      carried them (what it keeps is its input less these).
    shard_residual: float32 ``[c L]`` what the rounding of this worker's
      shard of the mean lost, owed to the next mean.
  """

  mean: jax.Array
  own: jax.Array
  shard_residual: jax.Array


def shards(accumulated: jax.Array, length: int, num_workers: int) -> jax.Array:
  """``accumulated`` ``[N]`` zero-padded to ``[n, c, L]``: ``c`` whole chunks of ``L`` a worker."""
  shard = shard_size(accumulated.shape[0], length, num_workers)
  padded = jnp.pad(accumulated, (0, num_workers * shard - accumulated.shape[0]))
  return padded.reshape(num_workers, shard // length, length)


def shard_size(num_elements: int, length: int, num_workers: int) -> int:
  """Elements of each worker's shard, ``c L``: ``c`` the chunks over ``n``, rounded up."""
  chunks = -(-num_elements // length)
  return -(-chunks // num_workers) * length


def message_bytes(shard: int, length: int, value_bits: int) -> int:
  """Bytes of one shard's message: its codes and a scale a chunk."""
  return _packed.message_bytes(shard // length, length, length, value_bits)


def sent_bytes(num_workers: int, shard: int, length: int, value_bits: int,
               mean_bits: int) -> int:
  """Bytes one worker sends: ``n - 1`` shard messages in each pass."""
  return _collectives.ring_all_gather_bytes(
      num_workers, message_bytes(shard, length, value_bits) + message_bytes(
          shard, length, mean_bits))


def all_reduce(rows: jax.Array, shard_residual: jax.Array, axis_name: str,
               value_bits: int, mean_bits: int) -> QuantizedMean:
  """The workers' mean of ``rows`` (`shards` of this worker's values) in two quantized passes.

  Args:
    rows: float32 ``[n, c, L]`` this worker's values, shard ``w`` for worker ``w``.
    shard_residual: float32 ``[c L]`` what this worker's shard of the last mean lost.
    axis_name: the data-parallel axis.
    value_bits: ``b``, the bits of the workers' values: 1, 2, 4 or 8 (`_packed.quantize`).
    mean_bits: ``b'``, the bits of the owners' means.

  Returns:
    The `QuantizedMean`.
  """
  per_worker, length = rows.shape[1:]
  messages = jax.vmap(lambda shard: encoded(shard, length, value_bits))(rows)
  received = jax.lax.all_to_all(messages, axis_name, 0, 0, tiled=False)  # my shard, from each
  mean = (jnp.mean(decoded(received, per_worker, length, value_bits), axis=0)
          + shard_residual.reshape(per_worker, length))
  gathered = _collectives.all_gather(encoded(mean, length, mean_bits), axis_name)
  means = decoded(gathered, per_worker, length, mean_bits)
  return QuantizedMean(mean=means, own=decoded(messages, per_worker, length, value_bits),
                       shard_residual=(mean - means[jax.lax.axis_index(axis_name)]).reshape(-1))


def encoded(values: jax.Array, length: int, value_bits: int) -> jax.Array:
  """uint8 message of whole chunks ``values`` ``[c, L]`` (no offsets)."""
  whole = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), values.shape)
  return _packed.encode(_packed.Picks(whole, values), length, value_bits)


def decoded(messages: jax.Array, per_worker: int, length: int, value_bits: int) -> jax.Array:
  """float32 ``[n, c, L]`` values of ``messages`` ``[n, bytes]``."""
  return _packed.decode(messages, per_worker, length, length, value_bits).values

