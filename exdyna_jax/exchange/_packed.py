"""A compact wire: chunk offsets in ``log2 L`` bits, values in 1 to 32 bits, one all-gather.

A worker that picks the same number ``m`` of elements in every chunk of
``L`` elements (``L <= 65536``) need not send its indices in 32 bits: the
position of a pick in its message says its chunk, and its offset in the
chunk fits ``ceil(log2 L)`` bits (12 for chunks of 4,096), packed into a
stream of bytes. Its values go as a float dtype (float32, bfloat16,
float16: ``values_as`` a dtype) or in ``b`` = 1, 2, 4 or 8 bits
(``values_as`` the int ``b``): a sign bit and ``b - 1`` bits of
magnitude, on a scale per chunk (the chunk's largest magnitude picked, a
float32; for one bit, the sign alone on the picks' mean magnitude), packed
``8 / b`` to a byte. One ``all_gather`` of a byte buffer
moves all of it; every worker decodes every message to the same
``(indices, values)``. Whole chunks (``m = L``: every element, in place)
go without offsets.

What the rounding takes from a worker's values is its own to keep: the
caller keeps ``accumulated - decoded`` in its residual (error feedback), as
SparseLoCo does with its 2-bit values.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from exdyna_jax.core import _collectives

MAX_CHUNK = 1 << 16  # offsets in a chunk take at most 16 bits
VALUE_BITS = (1, 2, 4, 8)  # quantized values, on a scale per chunk
SCALE_BYTES = 4

ValuesAs = Any  # a float dtype (float32, bfloat16, float16) or an int of `VALUE_BITS`


class Picks(NamedTuple):
  """One worker's picks: ``m`` per chunk.

  Attributes:
    offsets: int32 ``[chunks, m]`` positions in each chunk, below ``L``.
    values: float32 ``[chunks, m]`` the values there.
  """

  offsets: jax.Array
  values: jax.Array


def quantized(values_as: ValuesAs) -> bool:
  """Whether ``values_as`` is a bit count (values on a scale per chunk), not a dtype."""
  return isinstance(values_as, int)


def offset_bits(length: int) -> int:
  """Bits of an offset in a chunk of ``length`` elements: ``ceil(log2 length)``, at least 1."""
  return max(1, (length - 1).bit_length())


def message_bytes(chunks: int, per_chunk: int, length: int, values_as: ValuesAs) -> int:
  """Bytes of one worker's message: its offsets, values and (quantized) scales."""
  picks = chunks * per_chunk
  offsets = _offset_bytes(picks, per_chunk, length)
  if not quantized(values_as):
    return offsets + np.dtype(values_as).itemsize * picks
  return offsets + -(-picks * values_as // 8) + chunks * SCALE_BYTES


def quantize(values: jax.Array, value_bits: int) -> tuple[jax.Array, jax.Array]:
  """``(codes, scales)``: uint8 ``[chunks, m]`` codes and float32 ``[chunks]`` scales.

  A code is the sign (its top bit) and the magnitude's level ``q`` below
  ``2**(b - 1)``: ``|v| / scale`` cut into equal steps (`dequantize` reads
  each step's middle), the scale the chunk's largest magnitude. One bit is
  the sign alone, on the chunk's mean magnitude (the scale that loses the
  least: a scaled sign).
  """
  levels = 1 << (value_bits - 1)
  if value_bits == 1:
    return jnp.where(values < 0, jnp.uint8(1), jnp.uint8(0)), jnp.mean(jnp.abs(values), axis=1)
  scales = jnp.max(jnp.abs(values), axis=1)
  ratio = jnp.abs(values) / jnp.where(scales > 0, scales, 1.0)[:, None]
  level = jnp.minimum(jnp.floor(ratio * levels), levels - 1).astype(jnp.uint8)
  return level | jnp.where(values < 0, jnp.uint8(levels), jnp.uint8(0)), scales


def dequantize(codes: jax.Array, scales: jax.Array, value_bits: int) -> jax.Array:
  """float32 values of ``codes`` (``[..., chunks, m]``) on ``scales`` (``[..., chunks]``)."""
  levels = 1 << (value_bits - 1)
  sign = jnp.where(codes & levels, -1.0, 1.0)
  if value_bits == 1:
    return sign * scales[..., None]
  magnitude = ((codes & (levels - 1)).astype(jnp.float32) + 0.5) / levels
  return sign * magnitude * scales[..., None]


def rounded(values: jax.Array, values_as: ValuesAs) -> jax.Array:
  """float32 ``values`` as the wire carries them: what every worker decodes."""
  if quantized(values_as):
    return dequantize(*quantize(values, values_as), values_as)
  return _narrowed(values, values_as).astype(jnp.float32)


def encode(picks: Picks, length: int, values_as: ValuesAs) -> jax.Array:
  """uint8 ``[message_bytes]``: the offsets, then the values (and the scales).

  Whole chunks (``m = L``, every element in place: offsets ``0 .. L - 1``)
  go without offsets.
  """
  offsets = (jnp.zeros((0,), jnp.uint8) if picks.offsets.shape[1] == length
             else _bit_stream(picks.offsets.reshape(-1), offset_bits(length)))
  if not quantized(values_as):
    return jnp.concatenate([offsets, _as_bytes(_narrowed(picks.values.reshape(-1), values_as))])
  codes, scales = quantize(picks.values, values_as)
  return jnp.concatenate([offsets, _bit_stream(codes.reshape(-1), values_as), _as_bytes(scales)])


def decode(message: jax.Array, chunks: int, per_chunk: int, length: int,
           values_as: ValuesAs) -> Picks:
  """The `Picks` of a message (``[..., message_bytes]``, any leading axes)."""
  lead, picks = message.shape[:-1], chunks * per_chunk
  shape = (*lead, chunks, per_chunk)
  offset_bytes = _offset_bytes(picks, per_chunk, length)
  if per_chunk == length:
    offsets = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (*lead, chunks, length))
  else:
    offsets = _fields(message[..., :offset_bytes], picks, offset_bits(length)).astype(jnp.int32)
  rest = message[..., offset_bytes:]
  if not quantized(values_as):
    return Picks(offsets.reshape(shape),
                 _from_bytes(rest, values_as).astype(jnp.float32).reshape(shape))
  value_bytes = -(-picks * values_as // 8)
  codes = _fields(rest[..., :value_bytes], picks, values_as).astype(jnp.uint8)
  scales = _from_bytes(rest[..., value_bytes:], jnp.float32)
  return Picks(offsets.reshape(shape), dequantize(codes.reshape(shape), scales, values_as))


def gather(picks: Picks, length: int, axis_name: str, values_as: ValuesAs) -> Picks:
  """Every worker's `Picks` (``[n, chunks, m]`` each) as the wire carries them."""
  chunks, per_chunk = picks.offsets.shape
  gathered = _collectives.all_gather(encode(picks, length, values_as), axis_name)
  return decode(gathered, chunks, per_chunk, length, values_as)


def _offset_bytes(picks: int, per_chunk: int, length: int) -> int:
  """Bytes of a message's offsets: none for whole chunks (every element, in place)."""
  return 0 if per_chunk == length else -(-picks * offset_bits(length) // 8)


def _narrowed(values: jax.Array, dtype) -> jax.Array:
  """``values`` in a float ``dtype``, clipped to its range (float16's 65,504)."""
  if np.dtype(dtype) == np.float32:
    return values
  limit = float(jnp.finfo(dtype).max)
  return jnp.clip(values, -limit, limit).astype(dtype)


def _as_bytes(x: jax.Array) -> jax.Array:
  """uint8 ``[size * itemsize]``: the bytes of a flat array."""
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(raw: jax.Array, dtype) -> jax.Array:
  """``[..., size]`` of ``dtype`` from uint8 ``[..., size * itemsize]``."""
  width = jnp.dtype(dtype).itemsize
  return jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, width), dtype)


def _bit_stream(fields: jax.Array, bits: int) -> jax.Array:
  """uint8 ``[ceil(size * bits / 8)]``: the low ``bits`` of each of ``fields`` (at most 16),
  one after another, least significant bit first (so ``8 / b`` codes of ``b`` bits fill a
  byte, the first in its low bits). Each byte gathers the few fields it holds bits of."""
  size = -(-fields.shape[0] * bits // 8)
  reach = -(-8 // bits) + 1  # the fields one byte can hold bits of
  fields = jnp.pad(fields.astype(jnp.uint32), (0, reach))
  start = 8 * jnp.arange(size, dtype=jnp.uint32)
  first, shift = start // bits, start % bits
  byte = fields[first] >> shift
  for later in range(1, reach):
    byte |= fields[first + later] << (later * bits - shift)
  return (byte & 0xFF).astype(jnp.uint8)


def _fields(stream: jax.Array, count: int, bits: int) -> jax.Array:
  """uint32 ``[..., count]`` fields of ``bits`` from `_bit_stream`'s bytes ``[..., bytes]``."""
  reach = (bits + 7) // 8 + 1  # the bytes one field can span
  stream = jnp.pad(stream.astype(jnp.uint32), [(0, 0)] * (stream.ndim - 1) + [(0, reach)])
  start = bits * jnp.arange(count, dtype=jnp.uint32)
  first, shift = start // 8, start % 8
  word = stream[..., first]
  for later in range(1, reach):
    word |= stream[..., first + later] << (8 * later)
  return (word >> shift) & ((1 << bits) - 1)
