"""The two passes over a partition as Pallas kernels, for NVIDIA GPUs (Triton, Ampere and newer).

`_selection.count_in_range` and `_selection.select_in_range` read a
worker's partition in chunks. XLA runs such a loop from the host: a GPU
reads the loop's condition back after every iteration and launches the next
one's kernels after it. Here each pass is one kernel launch (two for the
selection) whose programs walk the partition themselves, so the host
launches a fixed number of kernels whatever the partition's length, and
reads nothing back.

Program ``p`` of a launch reads the slice ``[begin + p S, begin + (p + 1) S)``
of the range ``[begin, end)`` (``S`` = `span`), `BLOCK` elements at a time,
and stops at ``end``; the grid covers the longest range, ``N``. A block
that would cross the end of the vector reads the last `BLOCK` elements
instead and counts only those not read before (as `_selection.chunk_window`
does), so every read is in bounds without masks; the vector must hold at
least `BLOCK` elements (`fits`).

The results are the loops' own: the same counts and largest magnitude, the
same lowest ``C`` passing indices (exact integers, compared in
``tests/test_range_kernels.py``). `on_kernel_platforms` picks them or the
loops when a pass is traced. On a CPU the kernels run in Pallas'
interpreter, for those tests only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

ROW = 32  # elements per row of the selection's bit masks (`_selection.ROW`)
ROWS = 32  # rows a block of the selection reads at once
BLOCK = ROW * ROWS  # elements a program reads at once
PROBE_LANES = 32  # probe thresholds counted at once (padded with +inf)
WARPS = 4  # warps per program
PROGRAMS_PER_CHUNK = 64  # programs that share one chunk of the loops (a quarter share)
KERNEL_PLATFORMS = ("cuda",)  # where the passes over a range are these kernels
MIN_COMPUTE_CAPABILITY = (8, 0)  # Pallas' Triton backend: Ampere and newer

_TRITON = pl_triton.CompilerParams(num_warps=WARPS)


def fits(num_elements: int) -> bool:
  """Whether the kernels can read a vector of ``N`` elements (at least `BLOCK`)."""
  return num_elements >= BLOCK


def span(chunk: int) -> int:
  """Elements each program reads: whole blocks, a `PROGRAMS_PER_CHUNK`-th of the loops' ``chunk``.

  A fair partition is four chunks (`_selection.chunk_length`), so about 256
  programs share it: enough to fill a GPU, few enough that the per-program
  results stay small.
  """
  return BLOCK * max(1, chunk // (PROGRAMS_PER_CHUNK * BLOCK))


def on_kernel_platforms(kernel: Callable[[str], Callable], loop: Callable,
                        accumulated: jax.Array, *args: Any) -> Any:
  """``kernel(platform)(accumulated, *args)`` on `KERNEL_PLATFORMS`, ``loop(...)`` elsewhere.

  The kernels replace a pass's loop where the vector is long enough for
  them (`fits`) and the devices can run them (`kernel_platforms`); on a
  CPU (in tests) they run in Pallas' interpreter.
  """
  platforms = kernel_platforms()
  if not platforms or not fits(accumulated.shape[0]):
    return loop(accumulated, *args)
  kernels = {platform: kernel(platform) for platform in platforms}
  return jax.lax.platform_dependent(accumulated, *args, **kernels, default=loop)


def kernel_platforms() -> tuple[str, ...]:
  """`KERNEL_PLATFORMS` whose devices can run the kernels: NVIDIA GPUs older than
  `MIN_COMPUTE_CAPABILITY` (a T4, a V100) keep the loops. Where this process has
  no device of a platform (lowering for another machine), the kernels are kept."""
  return tuple(platform for platform in KERNEL_PLATFORMS if _devices_run_kernels(platform))


def _devices_run_kernels(platform: str) -> bool:
  try:
    devices = jax.devices(platform)
  except RuntimeError:  # no such backend here
    return True
  capabilities = [getattr(device, "compute_capability", None) for device in devices]
  return all(c is None or tuple(map(int, str(c).split(".")[:2])) >= MIN_COMPUTE_CAPABILITY
             for c in capabilities)


def _program_blocks(bounds_ref, span_length: int):
  """``(first, end, blocks)``: where this program starts, the range's end, its block count."""
  begin, end = bounds_ref[0], bounds_ref[1]
  first = begin + pl.program_id(0) * span_length
  blocks = jnp.clip((end - first + BLOCK - 1) // BLOCK, 0, span_length // BLOCK)
  return first, end, blocks


def _block_window(first, index, end, rows):
  """``(start, ids, new)`` of block ``index``: where it starts, the positions read
  (``[BLOCK]``, or ``[rows, ROW]``), and which of them are new in the range.

  The block starts at ``first + index * BLOCK``, or, where that would cross
  ``end``, ends there (at least at 0): always ``BLOCK`` elements in bounds.
  ``rows`` is None for a flat block, else its number of rows of `ROW`.
  """
  nominal = first + index * BLOCK
  start = jnp.maximum(jnp.minimum(nominal, end - BLOCK), 0)
  if rows is None:
    ids = start + jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
  else:
    ids = start + ROW * jax.lax.broadcasted_iota(jnp.int32, (rows, ROW), 0) + (
        jax.lax.broadcasted_iota(jnp.int32, (rows, ROW), 1))
  return start, ids, (ids >= nominal) & (ids < end)


def _count_kernel(bounds_ref, thresholds_ref, accumulated_ref, counts_ref, largest_ref, *,
                  span_length):
  first, end, blocks = _program_blocks(bounds_ref, span_length)
  thresholds = thresholds_ref[...]

  def count_block(index, carry):
    counts, largest = carry
    start, _, new = _block_window(first, index, end, None)
    magnitudes = jnp.abs(accumulated_ref[pl.ds(start, BLOCK)])
    # Outside the range -1 passes no threshold (NaN passes none either).
    magnitudes = jnp.where(new & (magnitudes == magnitudes), magnitudes, -1.0)
    passed = magnitudes[None, :] >= thresholds[:, None]
    return counts + jnp.sum(passed.astype(jnp.int32), axis=1), jnp.maximum(
        largest, jnp.max(magnitudes))

  counts, largest = jax.lax.fori_loop(
      0, blocks, count_block, (jnp.zeros((PROBE_LANES,), jnp.int32), jnp.float32(0.0)))
  counts_ref[0, :] = counts
  largest_ref[0] = largest


def count_in_range(accumulated: jax.Array, begin: jax.Array, end: jax.Array,
                   thresholds: jax.Array, *, chunk: int, interpret: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
  """`_selection.count_in_range` in one kernel launch.

  Args:
    accumulated: float32 ``[N]``, ``N >= BLOCK``.
    begin: int32 first index of the range.
    end: int32 one past its last index.
    thresholds: float32 ``[P]``, ``P <= PROBE_LANES``.
    chunk: the loops' chunk length (`_selection.chunk_length`): sets how
      much a program reads (`span`).
    interpret: run in Pallas' interpreter (on a CPU).

  Returns:
    ``(counts, largest)``: int32 ``[P]`` and the float32 largest ``|a|`` in
    the range (0 for an empty range; NaN is never the largest).
  """
  (num_elements,), (num_thresholds,) = accumulated.shape, thresholds.shape
  span_length = span(chunk)
  programs = pl.cdiv(num_elements, span_length)
  lanes = jnp.pad(thresholds, (0, PROBE_LANES - num_thresholds), constant_values=jnp.inf)
  bounds = _bounds(begin, end)
  result = functools.partial(_result_type, accumulated, bounds, lanes)
  counts, largest = pl.pallas_call(
      functools.partial(_count_kernel, span_length=span_length),
      grid=(programs,),
      out_specs=(pl.BlockSpec((1, PROBE_LANES), lambda p: (p, 0)),
                 pl.BlockSpec((1,), lambda p: (p,))),
      out_shape=(result((programs, PROBE_LANES), jnp.int32), result((programs,), jnp.float32)),
      interpret=interpret,
      compiler_params=_TRITON,
      name="count_in_range",
  )(bounds, lanes, accumulated)
  return jnp.sum(counts, axis=0)[:num_thresholds], jnp.max(largest)


def _row_masks(accumulated_ref, threshold, first, index, end):
  """Block ``index``'s rows: ``(row_starts, masks, passed)``, each ``[ROWS]``.

  Bit ``j`` of a row's int32 mask is its element ``j`` (new in the range and
  ``|a| >= threshold``); ``passed`` counts them.
  """
  start, ids, new = _block_window(first, index, end, ROWS)
  passing = new & (jnp.abs(accumulated_ref[ids]) >= threshold)  # NaN passes no threshold
  bits = jax.lax.broadcasted_iota(jnp.int32, (ROWS, ROW), 1)
  masks = jnp.sum(jnp.where(passing, jnp.left_shift(1, bits), 0), axis=1)  # distinct bits: OR
  row_starts = start + ROW * jax.lax.broadcasted_iota(jnp.int32, (ROWS,), 0)
  return row_starts, masks, jnp.sum(passing.astype(jnp.int32), axis=1)


def _row_count_kernel(bounds_ref, threshold_ref, accumulated_ref, rows_ref, passed_ref, *,
                      span_length):
  first, end, blocks = _program_blocks(bounds_ref, span_length)
  threshold = threshold_ref[0]

  def count_block(index, carry):
    _, masks, passed = _row_masks(accumulated_ref, threshold, first, index, end)
    return carry[0] + jnp.sum((masks != 0).astype(jnp.int32)), carry[1] + jnp.sum(passed)

  rows, passed = jax.lax.fori_loop(0, blocks, count_block, (jnp.int32(0), jnp.int32(0)))
  rows_ref[0] = rows
  passed_ref[0] = passed


def _row_keep_kernel(bounds_ref, threshold_ref, offsets_ref, accumulated_ref, starts_ref,
                     masks_ref, *, span_length, capacity):
  first, end, blocks = _program_blocks(bounds_ref, span_length)
  threshold = threshold_ref[0]
  offset = offsets_ref[pl.program_id(0)]
  # Rows past the buffer go to scratch slots after it: one per row of a block.
  scratch = capacity + jax.lax.broadcasted_iota(jnp.int32, (ROWS,), 0)

  def keep_block(index, kept):
    row_starts, masks, _ = _row_masks(accumulated_ref, threshold, first, index, end)
    nonempty = masks != 0
    slots = kept + jnp.cumsum(nonempty.astype(jnp.int32)) - 1
    slots = jnp.where(nonempty & (slots < capacity), slots, scratch)
    starts_ref[slots] = row_starts
    masks_ref[slots] = masks
    return kept + jnp.sum(nonempty.astype(jnp.int32))

  jax.lax.fori_loop(0, jnp.where(offset < capacity, blocks, 0), keep_block, offset)


def first_rows(accumulated: jax.Array, threshold: jax.Array, begin: jax.Array, end: jax.Array,
               *, capacity: int, chunk: int, interpret: bool = False
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The first ``C`` non-empty rows of ``|a| >= threshold`` in ``[begin, end)``.

  Two launches: each program counts its non-empty rows, and after an
  exclusive sum over the programs each writes its own at their ranks
  (`_selection.select_in_range` turns the rows into indices).

  Args:
    accumulated: float32 ``[N]``, ``N >= BLOCK``.
    threshold: float32 scalar.
    begin: int32 first index of the range.
    end: int32 one past its last index.
    capacity: static ``C``.
    chunk: the loops' chunk length (`_selection.chunk_length`): sets how
      much a program reads (`span`).
    interpret: run in Pallas' interpreter (on a CPU).

  Returns:
    ``(row_starts, masks, kept, passed)``: int32 ``[C]`` the first element of
    each kept row and uint32 ``[C]`` its bit mask (ascending; slots at or
    past ``kept`` hold anything), int32 ``kept`` rows and int32 ``passed``
    elements in the range.
  """
  (num_elements,) = accumulated.shape
  span_length = span(chunk)
  programs = pl.cdiv(num_elements, span_length)
  bounds, threshold = _bounds(begin, end), jnp.reshape(threshold, (1,)).astype(jnp.float32)
  result = functools.partial(_result_type, accumulated, bounds, threshold)
  per_program = result((programs,), jnp.int32)
  one = pl.BlockSpec((1,), lambda p: (p,))
  rows, passed = pl.pallas_call(
      functools.partial(_row_count_kernel, span_length=span_length),
      grid=(programs,), out_specs=(one, one), out_shape=(per_program, per_program),
      interpret=interpret, compiler_params=_TRITON, name="count_rows_in_range",
  )(bounds, threshold, accumulated)
  offsets = jnp.cumsum(rows) - rows
  slots = result((capacity + ROWS,), jnp.int32)
  row_starts, masks = pl.pallas_call(
      functools.partial(_row_keep_kernel, span_length=span_length, capacity=capacity),
      grid=(programs,), out_shape=(slots, slots),
      interpret=interpret, compiler_params=_TRITON, name="keep_rows_in_range",
  )(bounds, threshold, offsets, accumulated)
  kept = jnp.minimum(jnp.sum(rows), capacity)
  return (row_starts[:capacity], jax.lax.bitcast_convert_type(masks[:capacity], jnp.uint32),
          kept, jnp.sum(passed))


def _result_type(*args) -> jax.ShapeDtypeStruct:
  """``_result_type(*inputs, shape, dtype)``: a kernel's result, varying where its inputs do.

  Under ``jax.shard_map`` with ``check_vma`` a kernel's results must say
  over which manual axes they vary: over every axis some input varies over
  (the type of a sum that depends on each input).
  """
  *inputs, shape, dtype = args
  joint = sum((jnp.sum(jnp.ravel(x)[:0]).astype(jnp.float32) for x in inputs), jnp.float32(0))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(joint).manual_axis_type)


def _bounds(begin: jax.Array, end: jax.Array) -> jax.Array:
  return jnp.stack([jnp.asarray(begin, jnp.int32), jnp.asarray(end, jnp.int32)])
