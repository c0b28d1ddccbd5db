"""A compact wire: chunk offsets in ``log2 L`` bits, values in 1 to 32 bits, one all-gather.

A worker that picks the same number ``m`` of elements in every chunk of
``L`` elements (``L <= 65536``) need not send its indices in 32 bits: the
position of a pick in its message says its chunk, and its offset in the
chunk fits ``ceil(log2 L)`` bits (12 for chunks of 4,096), packed into a
stream of bytes. Its values go as a float dtype (float32, bfloat16,
float16: ``values_as`` a dtype) or in ``b`` = 1, 2, 4 or 8 bits
(``values_as`` the int ``b``): a sign bit and ``b - 1`` bits of
magnitude, on a scale per chunk (a float32 fitted to the picks by least
squares; for one bit, the sign alone on about their mean magnitude), packed
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
SCALE_FITS = 3  # least-squares rounds fitting a chunk's scale (`quantize`) ...
SCALE_GRID = 112  # ... on the grid largest * 2**(1 - j / 16), j < 112: twice it to 1/60
_GRID = (2.0 ** (1 - np.arange(SCALE_GRID) / 16)).astype(np.float32)
_GRID_BOUNDS = (2.0 ** (1 - (np.arange(1, SCALE_GRID) - 0.5) / 16)).astype(np.float32)

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
  ``L = 2**(b - 1)``, read back as ``(q + 1/2) / L`` of the chunk's scale
  (one bit: the sign on the scale). The scale is fitted to the chunk:
  from its largest magnitude, `SCALE_FITS` rounds of least squares (the
  scale that loses the least for the levels taken; for one bit the mean
  magnitude), each put on the grid of `_on_grid`, the levels taken
  anew (the nearest to each magnitude): a Lloyd iteration. On the grid,
  the levels do not depend on the order the fit's sums are added in, so
  every device and the NumPy model round alike.
  """
  magnitudes = jnp.abs(values)
  largest = jnp.max(magnitudes, axis=1)
  scales = largest
  for _ in range(SCALE_FITS if value_bits > 1 else 1):  # one bit's levels never change
    read_back = _read_back(_levels(magnitudes, scales, value_bits), value_bits)
    fitted = jnp.sum(magnitudes * read_back, axis=1) / jnp.sum(read_back * read_back, axis=1)
    scales = _on_grid(fitted, largest)
  sign = jnp.where(values < 0, jnp.uint8(1 << (value_bits - 1)), jnp.uint8(0))
  return _levels(magnitudes, scales, value_bits) | sign, scales


def _on_grid(fitted: jax.Array, largest: jax.Array) -> jax.Array:
  """``largest * 2**(1 - j / 16)`` nearest ``fitted`` (log scale), ``j < SCALE_GRID``."""
  below = fitted[:, None] < largest[:, None] * _GRID_BOUNDS
  return largest * jnp.asarray(_GRID)[jnp.sum(below, axis=1)]


def dequantize(codes: jax.Array, scales: jax.Array, value_bits: int) -> jax.Array:
  """float32 values of ``codes`` (``[..., chunks, m]``) on ``scales`` (``[..., chunks]``)."""
  top = 1 << (value_bits - 1)
  sign = jnp.where(codes & top, -1.0, 1.0)
  return sign * _read_back(codes & (top - 1), value_bits) * scales[..., None]


def _levels(magnitudes: jax.Array, scales: jax.Array, value_bits: int) -> jax.Array:
  """uint8 level of each magnitude on its chunk's scale: the nearest of `_read_back`'s."""
  levels = 1 << (value_bits - 1)
  ratio = magnitudes / jnp.where(scales > 0, scales, 1.0)[:, None]
  return jnp.minimum(jnp.floor(ratio * levels), levels - 1).astype(jnp.uint8)


def _read_back(levels: jax.Array, value_bits: int) -> jax.Array:
  """float32 magnitude, as a fraction of the scale, that each level stands for."""
  if value_bits == 1:
    return jnp.ones(levels.shape, jnp.float32)
  return (levels.astype(jnp.float32) + 0.5) / (1 << (value_bits - 1))


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
